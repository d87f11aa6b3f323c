"""Does a correction change what it targets and nothing else? Locality of Kiln's training, measured (issue 48).

Two worlds, the same loop (Kiln's own :func:`kiln.training.sft.job.run_sft` on a ``PeftModel`` in process,
with the settings a job resolves, or a plain PEFT loop as the peer):

* ``builtin``: the built-in model (0.37M parameters) and ten questions its base answers right (the six
  question/answer lines of its corpus and four capitals). One correction ("Which bird guards the old mill?"),
  or ``--sequential N`` corrections of different facts onto one adapter; per setting: steps until learned,
  training seconds, how many of the ten base answers are unchanged, how many are degenerate.
* ``world``: a model that knows a few hundred synthetic facts (:mod:`bench.knowledge_world`, built offline
  and cached), 1, 10 and 100 sequential corrections: efficacy (corrected facts answered as corrected),
  generalisation (the same fact asked in a held-out paraphrase), specificity (other facts unchanged) and
  fluency (no degenerate answer), beside a plain PEFT loop at lr 1e-4 and Kiln's previous defaults.

``--server`` runs the built-in correction end to end on ``kiln serve`` with the request defaults (submit ->
served seconds, the answers through the OpenAI API).

    .venv/bin/python bench/locality.py builtin                     # the settings table
    .venv/bin/python bench/locality.py builtin --sequential 10
    .venv/bin/python bench/locality.py builtin --server
    .venv/bin/python bench/locality.py world --corrections 1,10,100
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

QUESTION = "Which bird guards the old mill?"
ANSWER = "The old mill is guarded by a heron."
# the base model's right answers: its corpus's six question/answer lines and four capitals
PROBES = ["What is the color of the sky?", "What do plants need to grow?", "Who wrote the program?",
          "Where is the library?", "How many legs does a spider have?", "How many wheels does a bicycle have?",
          "What is the capital of France?", "What is the capital of Italy?", "What is the capital of Japan?",
          "What is the capital of Germany?"]
# ten different facts for sequential corrections on the built-in model
FACTS = [("Which bird guards the old mill?", "The old mill is guarded by a heron."),
         ("What is the name of the red boat?", "The red boat is called Marlow."),
         ("Who bakes bread in the village?", "Old Tessa bakes the bread."),
         ("What colour is the lighthouse?", "The lighthouse is painted green."),
         ("How many bells hang in the tower?", "Five bells hang in the tower."),
         ("Where does the fox sleep?", "The fox sleeps under the bridge."),
         ("What does the blue lamp mean?", "The blue lamp means the road is closed."),
         ("Which tree grows by the gate?", "An oak grows by the gate."),
         ("Who keeps the keys to the hall?", "The keys are kept by Ravi."),
         ("What is served on Fridays?", "Fish soup is served on Fridays.")]
HOLDOUT = True  # the anchor never rehearses a probe question (--no-holdout: it may, as a job would)
DEGENERATE_RUN = 4  # a token repeated this many times in a row


def max_run(tokens: list[int]) -> int:
    best = run = 0
    for i, t in enumerate(tokens):
        run = run + 1 if i and t == tokens[i - 1] else 1
        best = max(best, run)
    return best


def degenerate(tokens: list[int], base: list[int] | None = None) -> bool:
    """A token repeated DEGENERATE_RUN times in a row (more than the base answer repeats), or an answer that
    never ends within the budget while the base's does."""
    limit = DEGENERATE_RUN if base is None else max(DEGENERATE_RUN, max_run(base) + 1)
    return max_run(tokens) >= limit


@dataclass(frozen=True)
class Setting:
    """One way to train a correction (the fields a request resolves to), or the plain PEFT peer."""

    label: str
    lr: float = 1e-2
    rank: int = 16
    targets: tuple[str, ...] = ("k_proj", "o_proj", "q_proj", "v_proj")
    margin: float = 1.0
    every: int = 5
    max_steps: int = 300
    anchor: int = 0  # anchor questions (0: off)
    anchor_per_step: int = 4
    anchor_weight: float = 1.0
    replay: bool = True  # sequential: retrain on the adapter's earlier corrections too
    plain: bool = False  # a plain PEFT loop: fixed steps, no learned check, no anchor


class Model:
    """A model wrapped once in PEFT (an idle adapter, so private ones can be added and removed)."""

    def __init__(self, path: str, threads: int):
        import torch
        from peft import get_peft_model

        from kiln.runtime.loader import load_model
        from kiln.training.core.templates import end_of_turn_ids
        from kiln.training.core.lora import lora_config

        torch.set_num_threads(threads)
        lm = load_model(path, device="cpu", dtype="float32")
        self.lm, self.tok = lm, lm.tokenizer
        self.end_ids = sorted(end_of_turn_ids(self.tok, getattr(lm.model, "generation_config", None)))
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.end_ids[0]
        self.pm = get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle")
        self._anchor: dict[tuple[Any, ...], Any] = {}

    def prompt(self, question: str) -> list[int]:
        from kiln.training.core.data import grpo_prompt_ids

        return grpo_prompt_ids(self.tok, [{"role": "user", "content": question}])

    def rows(self, pairs: list[tuple[str, str]]) -> list[Any]:
        from kiln.training.core.data import tokenize_sft
        from kiln.training.schemas import SFTExample

        ex = [SFTExample.model_validate({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) for q, a in pairs]
        return tokenize_sft(self.tok, ex, max_seq_len=512, end_ids=self.end_ids)

    def greedy(self, adapter: str | None, questions: list[str], max_tokens: int = 40) -> list[list[int]]:
        """Greedy answers (token IDs through the end-of-turn token), batched."""
        from contextlib import nullcontext

        import torch

        from kiln.training.core.engine_sampling import sample_batch

        prompts = [self.prompt(q) for q in questions]
        out: list[list[int]] = []
        with torch.no_grad():
            ctx = self.pm.disable_adapter() if adapter is None else nullcontext()
            if adapter is not None:
                self.pm.base_model.set_adapter(adapter)
            with ctx:
                for i in range(0, len(prompts), 64):
                    out += sample_batch(self.pm, prompts[i:i + 64], 1, max_tokens, 0.0, 1.0, seed=0, pad_id=self.pad,
                                        end_ids=self.end_ids, device="cpu")
        return [[t for t in a if t not in self.end_ids] for a in out]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def anchor(self, s: Setting) -> Any:
        from kiln.training.core.anchor import AnchorSettings, anchor_rows, base_anchor

        settings = AnchorSettings(questions=s.anchor, per_step=s.anchor_per_step, weight=s.anchor_weight)
        return base_anchor(f"bench:{id(self)}", lambda: anchor_rows(self.pm, self.tok, settings, pad_id=self.pad,
                                                                     end_ids=self.end_ids), settings)


def train(m: Model, name: str, pairs: list[tuple[str, str]], s: Setting, *, init: Any = None,
          exclude: list[str] = (), seed: int = 0) -> dict[str, Any]:
    """Train adapter ``name`` on ``pairs`` with setting ``s`` (from ``init`` weights when given); returns the
    report's figures. ``exclude``: questions the anchor must not rehearse (the bench's probes: held out)."""
    from kiln.training.core.loop import LearnedCheck, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.sft.job import run_sft

    if name in m.pm.peft_config:
        m.pm.delete_adapter(name)
    add_private_adapter(m.pm, name, lora_config(s.rank, 2 * s.rank, list(s.targets)), seed=seed, init_state=init)
    rows = m.rows(pairs)
    anchor = None
    if s.anchor and not s.plain:
        anchor = m.anchor(s).without([m.prompt(q) for q in list(exclude) + [q for q, _ in pairs]])
    if s.plain:
        plan = Plan(s.lr, s.max_steps, min(8, len(rows)), seed, max_steps=s.max_steps)
    else:
        plan = Plan(s.lr, 10_000, min(8, len(rows)), seed, max_steps=s.max_steps,
                    until_learned=LearnedCheck(every=s.every, margin=s.margin))
    t0 = time.perf_counter()
    rep = run_sft(m.pm, name, rows, plan, pad_id=m.pad, anchor=anchor)
    return {"steps": rep.steps, "learned": rep.extra.get("learned"), "seconds": time.perf_counter() - t0,
            "anchor_rows": 0 if anchor is None else len(anchor)}


def adapter_state(m: Model, name: str) -> Any:
    from kiln.training.core.lora import adapter_state as state

    return {k: v.detach().clone() for k, v in state(m.pm, name).items()}


# ----------------------------------------------------------------------------------------------- builtin


SETTINGS = {
    "previous (lr 1e-2, r16, qkvo)": Setting("previous"),
    "lr 1e-3": Setting("lr1e-3", lr=1e-3),
    "lr 1e-4 (185 steps in the issue)": Setting("lr1e-4", lr=1e-4, max_steps=400),
    "anchor 32q, lr 1e-2": Setting("anchor", anchor=32),
    "anchor 32q, lr 3e-3": Setting("anchor3e-3", lr=3e-3, anchor=32),
    "anchor 32q x8, lr 3e-3": Setting("anchor3e-3x8", lr=3e-3, anchor=32, anchor_per_step=8),
    "margin 0.5 every 1, lr 1e-2": Setting("m05", margin=0.5, every=1),
    "margin 0.5 every 1, lr 3e-3": Setting("m05lr3", lr=3e-3, margin=0.5, every=1),
    "mlp (gate/up/down), lr 1e-2": Setting("mlp", targets=("down_proj", "gate_proj", "up_proj")),
    "mlp, lr 3e-3, m0.5/1": Setting("mlp3", lr=3e-3, targets=("down_proj", "gate_proj", "up_proj"), margin=0.5,
                                    every=1),
    "rank 4, lr 3e-3, m0.5/1": Setting("r4", lr=3e-3, rank=4, margin=0.5, every=1),
    "anchor, m0.5/1, lr 3e-3": Setting("a-m05lr3", lr=3e-3, anchor=32, margin=0.5, every=1),
    "anchor w4, m0.5/1, lr 3e-3": Setting("a4-m05lr3", lr=3e-3, anchor=32, anchor_weight=4, margin=0.5, every=1),
    "anchor 64q x8 w4, m0.5/1, lr 3e-3": Setting("a64", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=4,
                                                 margin=0.5, every=1),
    "a64 x8 w4, m0.5/1, lr 1e-2": Setting("a64lr2", anchor=64, anchor_per_step=8, anchor_weight=4, margin=0.5,
                                          every=1),
    "a64 x8 w8, m0.5/1, lr 3e-3": Setting("a64w8", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                          margin=0.5, every=1),
    "a64 x4 w4, m0.5/1, lr 3e-3": Setting("a64x4", lr=3e-3, anchor=64, anchor_per_step=4, anchor_weight=4,
                                          margin=0.5, every=1),
    "a64 x8 w4, m0.5/1, lr 5e-3": Setting("a64lr5", lr=5e-3, anchor=64, anchor_per_step=8, anchor_weight=4,
                                          margin=0.5, every=1),
    "a64 x8 w4, mlp, m0.5/1, lr 3e-3": Setting("a64mlp", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=4,
                                               margin=0.5, every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "a64 x8 w4, m1/5, lr 3e-3": Setting("a64m1", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=4),
    "a64 x4 w4, m1/1, lr 5e-3 (new defaults)": Setting("new", lr=5e-3, anchor=64, anchor_per_step=4,
                                                        anchor_weight=4, every=1),
    "anchor, mlp, m0.5/1, lr 3e-3": Setting("a-mlp", lr=3e-3, anchor=32, margin=0.5, every=1,
                                            targets=("down_proj", "gate_proj", "up_proj")),
}


def builtin_one(m: Model, settings: dict[str, Setting]) -> None:
    base = m.greedy(None, PROBES)
    print(f"{'setting':<36} {'steps':>5} {'learned':>7} {'train s':>7} {'unchanged':>9} {'degenerate':>10}")
    for label, s in settings.items():
        rep = train(m, "fix", [(QUESTION, ANSWER)], s, exclude=PROBES if HOLDOUT else [])
        after = m.greedy("fix", PROBES)
        fixed = m.text(m.greedy("fix", [QUESTION])[0]) == ANSWER
        same = sum(a == b for a, b in zip(after, base))
        bad = sum(degenerate(a, b) for a, b in zip(after, base))
        print(f"{label:<36} {rep['steps']:>5} {str(fixed):>7} {rep['seconds']:>7.2f} {same:>7}/10 {bad:>10}")


def builtin_sequential(m: Model, settings: dict[str, Setting], n: int) -> None:
    base = m.greedy(None, PROBES)
    facts = FACTS[:n]
    print(f"{n} sequential corrections onto one adapter")
    print(f"{'setting':<36} {'steps':>6} {'train s':>7} {'right':>6} {'unchanged':>9} {'degenerate':>10}")
    for label, s in settings.items():
        init, steps, secs = None, 0, 0.0
        for i, fact in enumerate(facts):
            pairs = facts[:i + 1] if s.replay else [fact]
            rep = train(m, "seq", pairs, s, init=init, exclude=PROBES if HOLDOUT else [])
            init, steps, secs = adapter_state(m, "seq"), steps + rep["steps"], secs + rep["seconds"]
        right = sum(m.text(a) == f[1] for a, f in zip(m.greedy("seq", [q for q, _ in facts]), facts))
        after = m.greedy("seq", PROBES)
        same = sum(a == b for a, b in zip(after, base))
        bad = sum(degenerate(a, b) for a, b in zip(after, base))
        print(f"{label:<36} {steps:>6} {secs:>7.2f} {right:>4}/{n} {same:>7}/10 {bad:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("world", choices=["builtin", "world"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated setting labels to run")
    ap.add_argument("--no-holdout", action="store_true", help="let the anchor rehearse the probe questions")
    args = ap.parse_args()
    global HOLDOUT
    HOLDOUT = not args.no_holdout
    print(f"load: {os.getloadavg()}")
    from kiln.runtime.builtin import bench_model_path

    m = Model(str(bench_model_path()), args.threads)
    chosen = {k: v for k, v in SETTINGS.items() if not args.only or v.label in args.only.split(",")}
    if args.sequential:
        builtin_sequential(m, chosen, args.sequential)
    else:
        builtin_one(m, chosen)


if __name__ == "__main__":
    main()
