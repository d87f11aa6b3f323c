"""A small model that knows a few hundred synthetic facts: the world bench/locality.py measures edits in.

Offline and reproducible: ``N_LANDS`` invented lands, each with a capital and a river (invented names from a
seeded syllable generator), so ``2 x N_LANDS`` facts. Each fact is asked in two training forms; a third,
paraphrased form is trained for the first half of the lands only, so the model learns that the paraphrase
means the same, and the second half's paraphrases are held out (the generalisation probe). A Qwen3-shaped
model with the built-in tokenizer and chat template is trained from scratch on these chats (loss on the
answers) with a fixed seed, and cached under the system temp dir, keyed by this file's SHA-256 and the
transformers version; weights are never committed.

    .venv/bin/python bench/knowledge_world.py        # build (or reuse) it and print what the base knows
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

N_LANDS = 100  # 200 facts
SEED = 1234
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
EPOCHS = 60
BATCH = 64
LR = 5e-3

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "sh"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
CODAS = ["", "", "n", "l", "r", "s", "th", "m"]

FORMS = {  # attribute -> (training forms, paraphrase form, answer)
    "capital": (["What is the capital of {e}?", "Which city is the capital of {e}?"],
                "Name the capital city of {e}.", "The capital of {e} is {v}."),
    "river": (["Which river flows through {e}?", "What river runs through {e}?"],
              "Name the river of {e}.", "The river of {e} is the {v}."),
}


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).title()


@dataclass(frozen=True)
class Fact:
    entity: str
    attribute: str
    value: str
    paraphrase_trained: bool

    def question(self, form: int = 0) -> str:
        return FORMS[self.attribute][0][form].format(e=self.entity)

    def paraphrase(self) -> str:
        return FORMS[self.attribute][1].format(e=self.entity)

    def answer(self, value: str | None = None) -> str:
        return FORMS[self.attribute][2].format(e=self.entity, v=value or self.value)


def world_facts(n_lands: int = N_LANDS, seed: int = SEED) -> list[Fact]:
    """The world's facts, lands in order; every name unique."""
    rng = random.Random(seed)
    used: set[str] = set()

    def fresh(syl: int) -> str:
        while True:
            n = _name(rng, syl)
            if n not in used:
                used.add(n)
                return n

    facts = []
    for i in range(n_lands):
        land = fresh(2)
        for attr in FORMS:
            facts.append(Fact(land, attr, fresh(2), paraphrase_trained=i < n_lands // 2))
    return facts


def other_values(facts: list[Fact], seed: int = SEED + 1) -> list[str]:
    """For each fact, a new value to correct it to: another fact's value of the same attribute (a counterfact)."""
    rng = random.Random(seed)
    out = []
    for f in facts:
        pool = [g.value for g in facts if g.attribute == f.attribute and g.value != f.value]
        out.append(rng.choice(pool))
    return out


def training_chats(facts: list[Fact]) -> list[tuple[str, str]]:
    chats = []
    for f in facts:
        for k in range(len(FORMS[f.attribute][0])):
            chats.append((f.question(k), f.answer()))
        if f.paraphrase_trained:
            chats.append((f.paraphrase(), f.answer()))
    return chats


def cache_dir() -> Path:
    """Keyed by everything the weights depend on: the world, the shape, the schedule and the transformers version
    (not this file's bytes, so moving an import does not retrain it)."""
    import json
    from importlib.metadata import version

    what = {"lands": N_LANDS, "seed": SEED, "shape": SHAPE, "epochs": EPOCHS, "batch": BATCH, "lr": LR,
            "names": [ONSETS, VOWELS, CODAS], "forms": FORMS, "transformers": version("transformers"),
            "torch": version("torch"), "loss": "sft_loss_from_hidden, OneCycleLR pct_start 0.05"}
    h = hashlib.sha256(json.dumps(what, sort_keys=True).encode())
    return Path(tempfile.gettempdir()) / "kiln-knowledge-world" / h.hexdigest()[:16]


def build(out: Path, threads: int = 2, log: Any = print) -> Path:
    """Train the world model into ``out`` (published by rename when complete)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from kiln.runtime.builtin import bench_model_path
    from kiln.training.losses.chunked import sft_loss_from_hidden
    from kiln.training.core.data import collate, tokenize_sft
    from kiln.training.schemas import SFTExample
    from kiln.training.core.templates import end_of_turn_ids

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(str(bench_model_path()))
    cfg = Qwen3Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32", architectures=["Qwen3ForCausalLM"],
                      **SHAPE)
    model = Qwen3ForCausalLM(cfg)
    chats = training_chats(world_facts())
    ex = [SFTExample.model_validate({"messages": [{"role": "user", "content": q},
                                                  {"role": "assistant", "content": a}]}) for q, a in chats]
    rows = tokenize_sft(tok, ex, max_seq_len=256, end_ids=end_of_turn_ids(tok))
    steps = EPOCHS * ((len(rows) + BATCH - 1) // BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.05)
    rng = random.Random(SEED)
    t0, step = time.perf_counter(), 0
    model.train()
    for epoch in range(EPOCHS):
        order = list(range(len(rows)))
        rng.shuffle(order)
        for b in range(0, len(order), BATCH):
            batch = collate([rows[i] for i in order[b:b + BATCH]], tok.pad_token_id)
            hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state  # the head only on the answers
            loss = sft_loss_from_hidden(hidden, model.lm_head.weight, batch["input_ids"], batch["loss_mask"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
        if epoch % 5 == 4:
            log(f"  epoch {epoch + 1}/{EPOCHS}: loss {float(loss):.4f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         do_sample=False).save_pretrained(staging)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"  trained {steps} steps in {time.perf_counter() - t0:.0f} s on {threads} threads")
    return out


def world_model(threads: int = 2, log: Any = print) -> Path:
    """The world model's directory: reused from the cache, else built (a few minutes on 2 cores)."""
    out = cache_dir()
    if not (out / "config.json").is_file():
        log(f"building the knowledge world into {out} ...")
        build(out, threads, log)
    return out


if __name__ == "__main__":
    print(world_model(int(os.environ.get("THREADS", "2"))))
