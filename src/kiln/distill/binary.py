"""Packed binary payload layout ``soup.autodistill.capture-packed.v1`` (``*.kdpack``).

Same semantics as ``soup.autodistill.capture-token.v1`` rows, stored as fixed
widths taken from the plan. Decoding yields exactly the ``CaptureTokenRow``s the
JSONL layout would hold, so manifests, hashes and verification are shared.

Layout (all integers little-endian)::

    magic            8 bytes   b"KILNKDP1"
    header_len       u32
    header           canonical JSON (schema, plan_sha256, trajectory, vocab_size,
                     top_k, temperature, max_sequence_length, truncation, the four
                     widths, examples, records)
    per example:
      id_len         u32, then example_id (UTF-8)
      context_len C  u32       length of position 0's exact (already truncated) context
      positions T    u32
      context        C x ID
      forced         T x ID    the trajectory's own token per position (target or sample)
      T records, each:
        top-k IDs    K x ID    rank order (most likely first)
        top-k log p  K x LP
        forced log p LP        only when K < V; NaN when the forced ID is in the top-k
        tail         TAIL
        entropy      ENT

ID widths are 1, 2, 4 or 8 bytes (unsigned); float widths are 4 (float32) or 8
(float64). Per captured token that is ``(K+1)(B_id+B_logp) + B_tail + B_entropy``
bytes when K < V, exactly the plan's ``sparse_upper_bytes / N`` for F = 1, plus a
per-example header. Context of position i is ``(context_0 + forced[:i])`` cut to
``max_sequence_length`` from the left. ``forced_ids`` of a decoded row is the
trajectory's own token alone: rows with more forced IDs cannot be packed.

This module imports no numpy/torch at module level (``shards`` imports it); the
array decoder used by the trainer imports numpy lazily.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from kiln.canonical import CanonicalJSONError, canonical_json_bytes, strict_json_loads
from kiln.distill.errors import ShardError

__all__ = [
    "PACKED_SCHEMA",
    "PACKED_SUFFIX",
    "MAGIC",
    "PackedExample",
    "packed_header",
    "encode_packed",
    "decode_packed_rows",
    "decode_packed_arrays",
    "check_packable",
    "record_bytes",
]

PACKED_SCHEMA = "soup.autodistill.capture-packed.v1"
PACKED_SUFFIX = ".kdpack"
MAGIC = b"KILNKDP1"
MAX_HEADER_BYTES = 1 << 16
_ID_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
_FLOAT_FMT = {4: "f", 8: "d"}
_HEADER_KEYS = {
    "schema", "plan_sha256", "trajectory", "vocab_size", "top_k", "temperature", "max_sequence_length",
    "truncation", "id_bytes", "logprob_bytes", "tail_bytes", "entropy_bytes", "examples", "records",
}


@dataclass
class PackedExample:
    """One example trajectory in columns (plain Python sequences or numpy arrays).

    Shapes: ``context [C]``, ``forced [T]``, ``top_ids [T, K]``, ``top_logprobs [T, K]``,
    ``forced_logprobs [T]`` (NaN where the forced ID is in the top-k), ``tail [T]``,
    ``entropy [T]``.
    """

    example_id: str
    context: Sequence[int]
    forced: Sequence[int]
    top_ids: Any
    top_logprobs: Any
    forced_logprobs: Any
    tail: Any
    entropy: Any


def check_packable(plan) -> None:  # plan: kiln.distill.contract.Plan
    prob = plan.probability
    if prob.id_bytes not in _ID_FMT:
        raise ShardError(f"packed layout stores IDs in 1, 2, 4 or 8 bytes; the plan says {prob.id_bytes}")
    if (1 << (8 * prob.id_bytes)) < plan.tokenizer.vocab_size:
        raise ShardError(f"id_bytes {prob.id_bytes} cannot hold vocabulary IDs up to {plan.tokenizer.vocab_size - 1}")
    for name in ("logprob_bytes", "tail_bytes", "entropy_bytes"):
        if getattr(prob, name) not in _FLOAT_FMT:
            raise ShardError(
                f"packed layout stores {name} as float32 (4) or float64 (8); the plan says {getattr(prob, name)} "
                "(narrower floats cannot keep tail_mass within the 1e-6 contract tolerance)"
            )


def record_bytes(plan) -> int:
    """Bytes of one position record, excluding the forced ID kept in the example header."""
    prob, v = plan.probability, plan.tokenizer.vocab_size
    k = prob.top_k
    return k * (prob.id_bytes + prob.logprob_bytes) + (prob.logprob_bytes if k < v else 0) + prob.tail_bytes + prob.entropy_bytes


def packed_header(plan, examples: int, records: int) -> dict[str, Any]:
    prob, cap = plan.probability, plan.capture
    return {
        "schema": PACKED_SCHEMA,
        "plan_sha256": plan.digest(),
        "trajectory": plan.consumption.trajectory,
        "vocab_size": plan.tokenizer.vocab_size,
        "top_k": prob.top_k,
        "temperature": prob.temperature,
        "max_sequence_length": cap.max_sequence_length,
        "truncation": cap.truncation,
        "id_bytes": prob.id_bytes,
        "logprob_bytes": prob.logprob_bytes,
        "tail_bytes": prob.tail_bytes,
        "entropy_bytes": prob.entropy_bytes,
        "examples": examples,
        "records": records,
    }


def _np_dtypes(header: dict[str, Any]):
    import numpy as np

    ids = np.dtype(f"<u{header['id_bytes']}")
    fl = {4: np.dtype("<f4"), 8: np.dtype("<f8")}
    return ids, fl[header["logprob_bytes"]], fl[header["tail_bytes"]], fl[header["entropy_bytes"]]


def _record_dtype(header: dict[str, Any]):
    import numpy as np

    ids, lp, tail, ent = _np_dtypes(header)
    k = header["top_k"]
    fields = [("top_ids", ids, (k,)), ("top_logprobs", lp, (k,))]
    if k < header["vocab_size"]:
        fields.append(("forced_logprob", lp))
    fields += [("tail", tail), ("entropy", ent)]
    return np.dtype(fields)


def encode_packed(plan, examples: Sequence[PackedExample]) -> bytes:
    """Pack whole example trajectories of ``plan`` into one payload's bytes."""
    import numpy as np

    check_packable(plan)
    records = sum(len(e.forced) for e in examples)
    header = packed_header(plan, len(examples), records)
    hj = canonical_json_bytes(header)
    ids_dt, _, _, _ = _np_dtypes(header)
    rec_dt = _record_dtype(header)
    out = [MAGIC, struct.pack("<I", len(hj)), hj]
    for e in examples:
        eid = e.example_id.encode("utf-8")
        t = len(e.forced)
        out.append(struct.pack("<I", len(eid)) + eid + struct.pack("<II", len(e.context), t))
        out.append(np.asarray(e.context, dtype=np.int64).astype(ids_dt).tobytes())
        out.append(np.asarray(e.forced, dtype=np.int64).astype(ids_dt).tobytes())
        rec = np.zeros(t, dtype=rec_dt)
        rec["top_ids"] = np.asarray(e.top_ids, dtype=np.int64).reshape(t, -1)
        rec["top_logprobs"] = np.asarray(e.top_logprobs, dtype=np.float64).reshape(t, -1)
        if "forced_logprob" in rec_dt.names:
            rec["forced_logprob"] = np.asarray(e.forced_logprobs, dtype=np.float64)
        rec["tail"] = np.asarray(e.tail, dtype=np.float64)
        rec["entropy"] = np.asarray(e.entropy, dtype=np.float64)
        out.append(rec.tobytes())
    return b"".join(out)


class _Reader:
    def __init__(self, raw: bytes, name: str):
        self.raw, self.name, self.at = raw, name, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.raw):
            raise ShardError(f"{self.name}: truncated packed payload (needs {n} bytes at offset {self.at})")
        out = self.raw[self.at : self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]


def _read_header(r: _Reader) -> dict[str, Any]:
    if r.take(len(MAGIC)) != MAGIC:
        raise ShardError(f"{r.name}: not a {PACKED_SCHEMA} payload (bad magic)")
    n = r.u32()
    if n > MAX_HEADER_BYTES:
        raise ShardError(f"{r.name}: packed header of {n} bytes is over {MAX_HEADER_BYTES}")
    raw = r.take(n)
    try:
        header = strict_json_loads(raw)
    except CanonicalJSONError as exc:
        raise ShardError(f"{r.name}: packed header: {exc}") from exc
    if not isinstance(header, dict) or header.get("schema") != PACKED_SCHEMA:
        raise ShardError(f"{r.name}: packed header schema must be {PACKED_SCHEMA!r}")
    if set(header) != _HEADER_KEYS or canonical_json_bytes(header) != raw:
        raise ShardError(f"{r.name}: packed header has unknown/missing keys or is not canonical")
    if header["id_bytes"] not in _ID_FMT or any(
        header[k] not in _FLOAT_FMT for k in ("logprob_bytes", "tail_bytes", "entropy_bytes")
    ):
        raise ShardError(f"{r.name}: unsupported packed widths")
    for k in ("vocab_size", "top_k", "examples", "records", "max_sequence_length"):
        if isinstance(header[k], bool) or not isinstance(header[k], int) or header[k] < 0:
            raise ShardError(f"{r.name}: packed header {k} must be a non-negative integer")
    if not 1 <= header["top_k"] <= header["vocab_size"]:
        raise ShardError(f"{r.name}: packed header top_k outside [1, vocab_size]")
    return header


def check_header_against_plan(header: dict[str, Any], plan, name: str) -> None:
    want = packed_header(plan, header["examples"], header["records"])
    diff = sorted(k for k in want if want[k] != header.get(k))
    if diff:
        raise ShardError(f"{name}: packed header differs from the plan in {', '.join(diff)}")


def _iter_examples(raw: bytes, name: str):
    """Yield (header, example_id, context, forced, records ndarray) per example."""
    import numpy as np

    r = _Reader(raw, name)
    header = _read_header(r)
    ids_dt, _, _, _ = _np_dtypes(header)
    rec_dt = _record_dtype(header)
    total = 0
    for _ in range(header["examples"]):
        try:
            eid = r.take(r.u32()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ShardError(f"{name}: example_id is not UTF-8") from exc
        c, t = r.u32(), r.u32()
        ctx = np.frombuffer(r.take(c * ids_dt.itemsize), dtype=ids_dt)
        forced = np.frombuffer(r.take(t * ids_dt.itemsize), dtype=ids_dt)
        recs = np.frombuffer(r.take(t * rec_dt.itemsize), dtype=rec_dt)
        total += t
        yield header, eid, ctx, forced, recs
    if r.at != len(raw):
        raise ShardError(f"{name}: {len(raw) - r.at} trailing bytes after the last packed example")
    if total != header["records"]:
        raise ShardError(f"{name}: header says {header['records']} records, found {total}")


def packed_trajectories(raw: bytes, name: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(example ID, position-0 context, forced tokens) of every example of a packed payload."""
    return [(eid, tuple(int(t) for t in ctx), tuple(int(t) for t in forced))
            for _h, eid, ctx, forced, _r in _iter_examples(raw, name)]


def decode_packed_header(raw: bytes, name: str) -> dict[str, Any]:
    return _read_header(_Reader(raw, name))


def decode_packed_rows(raw: bytes, name: str) -> tuple[dict[str, Any], list]:
    """(header, CaptureTokenRow list): the exact v1 rows the payload stands for.

    Every row is validated by the contract model (probability checks included).
    """
    import numpy as np

    from kiln.distill.contract import CAPTURE_TOKEN_SCHEMA, CaptureTokenRow
    from kiln.distill.errors import DistillError

    rows: list = []
    header: dict[str, Any] | None = None
    try:
        for header, eid, ctx, forced, recs in _iter_examples(raw, name):
            expert = header["trajectory"] == "teacher-expert"
            limit, left = header["max_sequence_length"], header["truncation"] == "left"
            context = [int(x) for x in ctx]
            has_forced_lp = "forced_logprob" in recs.dtype.names
            for pos in range(len(forced)):
                rec = recs[pos]
                tok = int(forced[pos])
                top = [int(x) for x in rec["top_ids"]]
                lp_of = {i: float(lp) for i, lp in zip(top, rec["top_logprobs"].tolist())}
                if tok not in lp_of:
                    flp = float(rec["forced_logprob"]) if has_forced_lp else math.nan
                    if math.isnan(flp):
                        raise ShardError(f"{name}: {eid}@{pos}: forced ID {tok} has no stored log p")
                    lp_of[tok] = flp
                elif has_forced_lp and not np.isnan(rec["forced_logprob"]):
                    raise ShardError(f"{name}: {eid}@{pos}: forced ID is in the top-k but has a second log p")
                sel = sorted(lp_of)
                rows.append(
                    CaptureTokenRow.model_validate(
                        {
                            "schema": CAPTURE_TOKEN_SCHEMA,
                            "example_id": eid,
                            "trajectory": header["trajectory"],
                            "position": pos,
                            "vocab_size": header["vocab_size"],
                            "context_token_ids": tuple(context),
                            "target_token_id": tok if expert else None,
                            "sampled_token_id": None if expert else tok,
                            "top_k_ids": tuple(top),
                            "forced_ids": (tok,),
                            "selected_ids": tuple(sel),
                            "selected_logprobs": tuple(lp_of[i] for i in sel),
                            "tail_mass": float(rec["tail"]),
                            "entropy": float(rec["entropy"]),
                            "temperature": header["temperature"],
                        }
                    )
                )
                context.append(tok)
                if len(context) > limit:
                    if not left:
                        if pos + 1 < len(forced):
                            raise ShardError(f"{name}: {eid}: right truncation cannot capture past the limit")
                    context = context[-limit:]
    except DistillError:
        raise
    except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
        raise ShardError(f"{name}: packed record is invalid: {str(exc)[:500]}") from exc
    if header is None:
        header = decode_packed_header(raw, name)
    return header, rows


def decode_packed_arrays(raw: bytes, name: str = "payload") -> tuple[dict[str, Any], list[PackedExample]]:
    """Fast column decode for training (numpy arrays, no per-row validation).

    Call only on payloads whose shard already passed ``verify_shard``.
    """
    out = []
    header: dict[str, Any] | None = None
    for header, eid, ctx, forced, recs in _iter_examples(raw, name):
        import numpy as np

        t = len(forced)
        flp = recs["forced_logprob"] if "forced_logprob" in recs.dtype.names else np.full(t, np.nan)
        out.append(
            PackedExample(
                example_id=eid,
                context=ctx.astype(np.int64),
                forced=forced.astype(np.int64),
                top_ids=recs["top_ids"].astype(np.int64).reshape(t, -1),
                top_logprobs=recs["top_logprobs"].astype(np.float64).reshape(t, -1),
                forced_logprobs=np.asarray(flp, dtype=np.float64),
                tail=recs["tail"].astype(np.float64),
                entropy=recs["entropy"].astype(np.float64),
            )
        )
    if header is None:
        header = decode_packed_header(raw, name)
    return header, out


_EXAMPLE_ID_RE = None


def check_packed(raw: bytes, name: str, plan) -> tuple[list[str], int, int]:
    """Verify a packed payload against ``plan`` without building row objects.

    Vectorized (numpy, float64 sums) form of exactly the checks a decoded row
    would get from ``CaptureTokenRow`` and ``check_rows_against_plan``: header ==
    plan, IDs inside the vocabulary, distinct top-k IDs, a stored log p for the
    forced ID iff it is outside the top-k, finite log p <= 0 (+1e-6), selected
    mass <= 1 (+1e-6), stored tail = 1 - mass (1e-6) and >= 0, no tail when S is
    the vocabulary, a forced-only ID no likelier than the weakest top-k ID,
    entropy within the bounds S and the tail allow (1e-4), contexts within
    ``max_sequence_length`` (right truncation never captures past it), and
    example IDs portable and unique. Contexts and positions are contiguous by
    construction of the layout. Returns (example IDs in order, rows, tokens).
    """
    import re

    import numpy as np

    from kiln.distill.probability import ENTROPY_TOLERANCE, LOGPROB_TOLERANCE, SELECTED_MASS_TOLERANCE

    global _EXAMPLE_ID_RE
    if _EXAMPLE_ID_RE is None:
        _EXAMPLE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    ids_seen: list[str] = []
    header: dict[str, Any] | None = None
    tokens = 0
    for header, eid, ctx, forced, recs in _iter_examples(raw, name):
        if len(ids_seen) == 0:
            check_header_against_plan(header, plan, name)
        where = f"{name}: {eid!r}"
        if not _EXAMPLE_ID_RE.fullmatch(eid):
            raise ShardError(f"{where}: example_id is not a portable ID")
        v, k, limit = header["vocab_size"], header["top_k"], header["max_sequence_length"]
        t, c = len(forced), len(ctx)
        if t == 0 or c == 0:
            raise ShardError(f"{where}: an example needs a context and at least one position")
        if c > limit or (header["truncation"] == "right" and c + t - 1 > limit):
            raise ShardError(f"{where}: context longer than max_sequence_length")
        top = recs["top_ids"].reshape(t, k).astype(np.int64)
        if (ctx >= v).any() or (forced >= v).any() or (top >= v).any():
            raise ShardError(f"{where}: a token ID is outside the vocabulary [0, {v})")
        if k > 1 and (np.diff(np.sort(top, axis=1), axis=1) == 0).any():
            raise ShardError(f"{where}: top_k_ids list an ID twice")
        top_lp = recs["top_logprobs"].reshape(t, k).astype(np.float64)
        in_top = (top == forced.astype(np.int64)[:, None]).any(axis=1)
        if "forced_logprob" in recs.dtype.names:
            flp = recs["forced_logprob"].astype(np.float64)
            if (np.isnan(flp) != in_top).any():
                raise ShardError(f"{where}: a forced log p must be stored exactly when the ID is outside the top-k")
        else:
            if not in_top.all():
                raise ShardError(f"{where}: K = V yet a forced ID is outside the top-k")
            flp = np.full(t, np.nan)
        extra = np.where(in_top, 0.0, flp)  # forced-only log p, 0 placeholder
        if not np.isfinite(top_lp).all() or not np.isfinite(extra).all():
            raise ShardError(f"{where}: a log-probability is not finite")
        if (top_lp > LOGPROB_TOLERANCE).any() or (extra > LOGPROB_TOLERANCE).any():
            raise ShardError(f"{where}: a log-probability is above 0")
        mass = np.exp(top_lp).sum(axis=1) + np.where(in_top, 0.0, np.exp(extra))
        if (mass > 1.0 + SELECTED_MASS_TOLERANCE).any():
            raise ShardError(f"{where}: selected probability mass exceeds 1")
        tail = recs["tail"].astype(np.float64)
        ent = recs["entropy"].astype(np.float64)
        if not np.isfinite(tail).all() or not np.isfinite(ent).all():
            raise ShardError(f"{where}: tail_mass or entropy is not finite")
        if (tail < 0).any() or (np.abs(tail - np.maximum(0.0, 1.0 - mass)) > SELECTED_MASS_TOLERANCE).any():
            raise ShardError(f"{where}: tail_mass differs from 1 - selected mass (selected must stay unnormalized)")
        rest = v - (k + (~in_top).astype(np.int64))
        if ((rest == 0) & (tail > SELECTED_MASS_TOLERANCE)).any():
            raise ShardError(f"{where}: S covers the vocabulary yet a tail remains")
        if (~in_top & (extra > top_lp.min(axis=1) + LOGPROB_TOLERANCE)).any():
            raise ShardError(f"{where}: a forced ID outranks the weakest top-k ID; top_k_ids is not the top-k")
        low = (-np.exp(top_lp) * top_lp).sum(axis=1) + np.where(in_top, 0.0, -np.exp(extra) * extra)
        safe_tail = np.where(tail > 0, tail, 1.0)
        spread = np.where((tail > 0) & (rest > 0), tail * np.log(np.maximum(rest, 1) / safe_tail), 0.0)
        if (ent < 0).any() or (ent < low - ENTROPY_TOLERANCE).any() or (ent > low + spread + ENTROPY_TOLERANCE).any():
            raise ShardError(f"{where}: entropy is outside the bounds implied by the selected IDs and tail")
        ids_seen.append(eid)
        tokens += t
    if header is None:
        check_header_against_plan(decode_packed_header(raw, name), plan, name)
    if len(set(ids_seen)) != len(ids_seen):
        raise ShardError(f"{name}: an example appears twice; trajectories are never split or repeated")
    return ids_seen, len(ids_seen), tokens
