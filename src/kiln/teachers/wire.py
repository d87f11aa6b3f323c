"""A compact binary form of a scoring answer, for Kiln-to-Kiln teaching (``Accept`` negotiation).

JSON prompt logprobs cost ~30-60 bytes per candidate; this layout costs 8
(a u32 token ID and an f32 log-probability). Media type
``application/x-kiln-prompt-logprobs``; all integers little-endian::

    magic  b"KPLP\\x01"
    u32 fingerprint length, fingerprint (UTF-8)     (also sent as x-kiln-teacher-fingerprint)
    u32 model length, model (UTF-8)
    u32 number of prompts
    per prompt: u32 number of positions, then per position:
        i32 count (-1: no row, the first position), count x u32 token IDs, count x f32 logprobs

Stdlib only. :func:`decode` checks every bound as it reads (truncation, counts,
token IDs below ``vocab_size``, at most ``top_k + 1`` per row).
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Sequence

MEDIA_TYPE = "application/x-kiln-prompt-logprobs"
FINGERPRINT_HEADER = "x-kiln-teacher-fingerprint"
MAGIC = b"KPLP\x01"
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_LITTLE = sys.byteorder == "little"


class WireError(ValueError):
    pass


def _arr(code: str, values: Any) -> bytes:
    a = array(code, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def encode(fingerprint: str, model: str, prompts: Sequence[Sequence[dict | None]]) -> bytes:
    """``prompts[p][t]``: ``None`` or a JSON prompt-logprob row ``{"<id>": {"logprob": ...}, ...}``."""
    fp, md = fingerprint.encode(), model.encode()
    out = [MAGIC, _U32.pack(len(fp)), fp, _U32.pack(len(md)), md, _U32.pack(len(prompts))]
    for rows in prompts:
        out.append(_U32.pack(len(rows)))
        for row in rows:
            if row is None:
                out.append(_I32.pack(-1))
                continue
            out.append(_I32.pack(len(row)))
            out.append(_arr("I", [int(k) for k in row]))
            out.append(_arr("f", [v["logprob"] for v in row.values()]))
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes):
        self.mv, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise WireError("binary scoring answer is truncated")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def i32(self) -> int:
        return _I32.unpack(self.take(4))[0]


def _text(r: _Reader, what: str) -> str:
    try:
        return bytes(r.take(r.u32())).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"the answer's {what} is not UTF-8") from None


def decode(data: bytes, *, vocab_size: int | None = None, top_k: int | None = None
           ) -> tuple[str, str, list[list[dict[int, float] | None]]]:
    """(fingerprint, model, rows per prompt as ``{token ID: logprob}``)."""
    r = _Reader(data)
    if bytes(r.take(len(MAGIC))) != MAGIC:
        raise WireError("not a kiln prompt-logprobs answer (bad magic)")
    fingerprint = _text(r, "fingerprint")
    model = _text(r, "model")
    prompts = []
    for _ in range(r.u32()):
        n = r.u32()
        if n > len(data):
            raise WireError("position count exceeds the answer's size")
        rows: list[dict[int, float] | None] = []
        for t in range(n):
            count = r.i32()
            if count == -1:
                rows.append(None)
                continue
            if count < 0 or (top_k is not None and count > top_k + 1):
                raise WireError(f"row {t} has {count} candidates, more than top_k + 1")
            ids = array("I")
            ids.frombytes(r.take(4 * count))
            lps = array("f")
            lps.frombytes(r.take(4 * count))
            if not _LITTLE:
                ids.byteswap()
                lps.byteswap()
            if vocab_size is not None and count and max(ids) >= vocab_size:
                raise WireError(f"token ID {max(ids)} at row {t} is outside the vocabulary width {vocab_size}")
            rows.append(dict(zip(ids, lps)))
        prompts.append(rows)
    if r.pos != len(data):
        raise WireError("trailing bytes after the binary scoring answer")
    return fingerprint, model, prompts


def transcode_json(body: dict[str, Any]) -> bytes | None:
    """The binary form of a JSON completion answer with prompt logprobs (``n = 1`` per prompt), else None."""
    choices = body.get("choices") or []
    rows = [c.get("prompt_logprobs") for c in sorted(choices, key=lambda c: c.get("index", 0))]
    if not rows or any(r is None for r in rows):
        return None
    return encode(str(body.get("system_fingerprint") or ""), str(body.get("model") or ""), rows)
