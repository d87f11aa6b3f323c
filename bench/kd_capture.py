"""A self-distillation capture for the benches' KD jobs (``POST /v1/train/kd``), built offline.

The teacher is the served model itself (teacher = student = ``model_dir``): a latency bench needs a KD
job's arithmetic, not a better student, and it keeps the bench free of a second model. The examples
are the chat texts given, tokenized with the model's own ``tokenizer.json``; the plan is written with
Kiln's fingerprints (``kiln.distill.local``, ``kiln.distill.dataset``) and the capture runs through the
ordinary command, ``kiln distill capture`` (a fresh child process), into ``out``. Its consumption
policy is ``chained`` replay, so one job may take many passes (``epochs``) over the same shard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

TOP_K = 16


def tokenized(model_dir: Path, pairs: list[tuple[str, str]]) -> list[dict]:
    """``(prompt, answer)`` texts as tokenized teacher examples (IDs of the model's tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [{"example_id": f"ex-{i:04d}", "prompt_token_ids": tok.encode(p, add_special_tokens=False).ids,
             "target_token_ids": tok.encode(a, add_special_tokens=False).ids} for i, (p, a) in enumerate(pairs)]


def write_plan(model_dir: Path, root: Path, examples: list[dict], max_len: int) -> Path:
    """``root/data/dataset.jsonl`` and ``root/plan.json``: teacher and student both ``model_dir``."""
    from kiln.canonical import atomic_write_bytes, canonical_json_bytes
    from kiln.distill.contract import complete_plan
    from kiln.distill.contract_types import TOKENIZED_TEACHER_EXAMPLE_SCHEMA
    from kiln.distill.dataset import fingerprint_dataset
    from kiln.distill.local import model_fingerprint, tokenizer_fingerprint

    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(data / "dataset.jsonl", b"".join(
        canonical_json_bytes({"schema": TOKENIZED_TEACHER_EXAMPLE_SCHEMA, **e}) + b"\n" for e in examples))
    ds = fingerprint_dataset(data, ["dataset.jsonl"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    renderer = version("transformers")
    fingerprint = model_fingerprint(model_dir).to_obj()
    plan = complete_plan({
        "run_id": f"bench-kd-{model_dir.name}", "teacher": fingerprint, "student": fingerprint,
        "tokenizer": tokenizer_fingerprint(model_dir, vocab_size=vocab, renderer_version=renderer).to_obj(),
        "dataset": ds.fingerprint.to_obj(),
        "capture": {"backend": "transformers", "backend_version": renderer, "dtype": "float32",
                    "quantization": "none", "max_sequence_length": max_len, "truncation": "left",
                    "planned_tokens": ds.target_tokens, "max_forced_ids": 1},
        "probability": {"top_k": TOP_K, "temperature": 1.0, "renormalize_selected": False,
                        "id_bytes": 4, "logprob_bytes": 4, "tail_bytes": 4, "entropy_bytes": 4},
        "consumption": {"trajectory": "teacher-expert", "replay": "chained", "rollout_checkpoint_sha256": None},
        "throughput_profile": None, "throughput_profile_sha256": None,
    })
    path = root / "plan.json"
    atomic_write_bytes(path, plan.canonical_bytes())
    return path


def self_capture(model_dir: Path, pairs: list[tuple[str, str]], work: Path, out: Path, max_len: int = 256) -> Path:
    """Capture ``pairs`` with ``model_dir`` as its own teacher into ``out`` (one shard); returns ``out``."""
    examples = tokenized(model_dir, pairs)
    plan = write_plan(model_dir, work, examples, max_len)
    kiln = str(Path(sys.executable).with_name("kiln"))
    cmd = [kiln, "distill", "capture", str(plan), "--teacher", str(model_dir), "--dataset-root", str(work / "data"),
           "--out", str(out), "--device", "cpu", "--examples-per-shard", str(len(examples))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kiln distill capture failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return out
