"""Tiny offline models and plans for the Milestone B worker tests (never downloads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.canonical import atomic_write_bytes, canonical_json_bytes
from kiln.distill.contract import TOKENIZED_TEACHER_EXAMPLE_SCHEMA, Plan, complete_plan
from kiln.distill.dataset import fingerprint_dataset
from kiln.distill.local import model_fingerprint, tokenizer_fingerprint

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)


def build_tiny_model(out: Path, *, vocab: int = 32, seed: int = 0, hidden: int = 32, layers: int = 1,
                     tokenizer_from: Path | None = None) -> Path:
    """A random Qwen3 (safetensors) with a word-level tokenizer of exactly ``vocab`` IDs."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, out / f.name)
    else:
        words = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab)}}
        tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(out))
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a peaked, non-uniform teacher/student distribution
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def write_dataset(root: Path, examples: list[dict]) -> Path:
    path = root / "dataset.jsonl"
    atomic_write_bytes(path, b"".join(
        canonical_json_bytes({"schema": TOKENIZED_TEACHER_EXAMPLE_SCHEMA, **e}) + b"\n" for e in examples))
    return path


def synthetic_examples(n: int, vocab: int, *, prompt: int = 4, target: int = 5, seed: int = 1) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {"example_id": f"ex-{i:04d}",
         "prompt_token_ids": [rng.randrange(1, vocab) for _ in range(prompt)],
         "target_token_ids": [rng.randrange(1, vocab) for _ in range(target)]}
        for i in range(n)
    ]


def make_plan(tmp: Path, teacher: Path, student: Path, examples: list[dict], *, top_k: int,
              trajectory: str = "teacher-expert", max_len: int = 64, widths=(4, 4, 4, 4),
              temperature: float = 1.0, backend: str = "transformers",
              backend_version: str | None = None) -> tuple[Path, Plan, Path]:
    """Write dataset + plan.json under ``tmp``; return (plan path, plan, dataset root)."""
    import transformers

    data_root = tmp / "data"
    data_root.mkdir(parents=True, exist_ok=True)
    write_dataset(data_root, examples)
    ds = fingerprint_dataset(data_root, ["dataset.jsonl"])
    vocab = json.loads((teacher / "config.json").read_text())["vocab_size"]
    rollout = trajectory == "student-rollout"
    config = {
        "run_id": "tiny-run",
        "teacher": model_fingerprint(teacher, "tiny/teacher").to_obj(),
        "student": model_fingerprint(student, "tiny/student").to_obj(),
        "tokenizer": tokenizer_fingerprint(teacher, vocab_size=vocab, renderer_version=transformers.__version__).to_obj(),
        "dataset": ds.fingerprint.to_obj(),
        "capture": {"backend": backend, "backend_version": backend_version or transformers.__version__,
                    "dtype": "float32",
                    "quantization": "none", "max_sequence_length": max_len, "truncation": "left",
                    "planned_tokens": ds.target_tokens, "max_forced_ids": 1},
        "probability": {"top_k": top_k, "temperature": temperature, "renormalize_selected": False,
                        "id_bytes": widths[0], "logprob_bytes": widths[1], "tail_bytes": widths[2],
                        "entropy_bytes": widths[3]},
        "consumption": {"trajectory": trajectory, "replay": "forbidden" if rollout else "chained",
                        "rollout_checkpoint_sha256": ("ab" * 32) if rollout else None},
        "throughput_profile": None,
        "throughput_profile_sha256": None,
    }
    plan = complete_plan(config)
    plan_path = tmp / "plan.json"
    atomic_write_bytes(plan_path, plan.canonical_bytes())
    return plan_path, plan, data_root


# ---------------------------------------------------------------- pytest fixtures

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(teacher dir, student dir) sharing one tokenizer, vocabulary 32."""
    root = tmp_path_factory.mktemp("kd-models")
    teacher = build_tiny_model(root / "teacher", vocab=32, seed=0)
    student = build_tiny_model(root / "student", vocab=32, seed=1, tokenizer_from=teacher)
    return teacher, student


def capture_in_process(tmp: Path, teacher: Path, plan_path: Path, data_root: Path, out: Path, **kw):
    from kiln.distill.capture import CaptureRequest, run_capture_child

    req = CaptureRequest(plan=str(plan_path), teacher=str(teacher), tokenizer=str(teacher),
                         dataset_root=str(data_root), out=str(out), device="cpu", **kw)
    return run_capture_child(req)
