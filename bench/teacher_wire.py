"""Scoring-answer wire formats for Kiln-to-Kiln teaching: JSON vs the compact binary layout.

    .venv/bin/python bench/teacher_wire.py [--positions 512] [--reps 5]

For K = 8, 64, 256 candidates per position (plus the actual token), one answer
of ``--positions`` positions is built the way Kiln's /v1/completions writes it
(``{"<id>": {"logprob", "rank", "decoded_token"}}`` rows) and as
``kiln.teachers.wire``'s binary form; printed: bytes per position and the
client's parse time (the JSON path: ``json.loads`` + the teacher client's row
checks; the binary path: ``wire.decode`` with the same checks), as ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiln.teachers.probe import parse_rows  # noqa: E402
from kiln.teachers.wire import decode, encode  # noqa: E402

VOCAB = 151_936  # a Qwen-sized vocabulary: realistic ID widths in JSON


def answer(positions: int, k: int, rng: random.Random) -> dict:
    rows = [None]
    for _ in range(positions - 1):
        ids = rng.sample(range(VOCAB), k + 1)
        rows.append({str(t): {"logprob": -rng.random() * 20, "rank": r + 1, "decoded_token": f"tok{t % 997}"}
                     for r, t in enumerate(ids)})
    return {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "teacher",
            "system_fingerprint": "kiln-teacher-v1." + "A" * 600 + "." + "0" * 64,
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": rows}]}


def median_s(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    print(f"{'K':>5} {'JSON B/pos':>11} {'binary B/pos':>13} {'bytes ratio':>12} {'JSON parse ms':>14} "
          f"{'binary parse ms':>16} {'parse ratio':>12}")
    for k in (8, 64, 256):
        body = answer(args.positions, k, rng)
        js = json.dumps(body).encode()
        bi = encode(body["system_fingerprint"], body["model"], [body["choices"][0]["prompt_logprobs"]])
        tj = median_s(lambda: parse_rows(json.loads(js)["choices"][0], vocab_size=VOCAB, top_k=k), args.reps)
        tb = median_s(lambda: decode(bi, vocab_size=VOCAB, top_k=k), args.reps)
        n = args.positions
        print(f"{k:>5} {len(js) / n:>11.0f} {len(bi) / n:>13.0f} {len(js) / len(bi):>11.1f}x {tj * 1e3:>14.1f} "
              f"{tb * 1e3:>16.1f} {tj / tb:>11.1f}x")


if __name__ == "__main__":
    main()
