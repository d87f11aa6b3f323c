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
served seconds, the answers through the HTTP API; ``--sequential N``: N corrections, each continuing the adapter;
``--previous``: with the fields of the defaults before the anchor). ``--grpo``: GRPO with rollouts rewarded for
one word, with the defaults and with lr 0.02 for 12 iterations, with and without the anchor.

    .venv/bin/python bench/locality.py builtin                     # the settings table
    .venv/bin/python bench/locality.py builtin --sequential 10
    .venv/bin/python bench/locality.py builtin --server --sequential 10
    .venv/bin/python bench/locality.py builtin --grpo
    .venv/bin/python bench/locality.py world --corrections 1,10,100 --only defaults,previous,plain
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

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


def degenerate(text: str, base: str = "") -> bool:
    """Degenerate by Kiln's one definition (:func:`kiln.training.core.degenerate.is_degenerate`), and the base's answer
    was not."""
    from kiln.training.core.degenerate import is_degenerate

    return is_degenerate(text) and not is_degenerate(base)


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
    world_anchor: bool = False  # world: the anchor asks the world's own fact questions (not the probes or edits)
    fresh: bool = False  # sequential: every job starts a new adapter (replay carries the earlier corrections)
    continuing_lr: float = 0.0  # sequential: the learning rate of every job after the first (0: lr)
    shuffle: bool = False  # sequential: job k takes the anchor's rows in its own seeded order (not always from row 0)
    whiten: float = 0.0  # key-whitened LoRA (bench/whitened_lora.py) with this damping over the anchor's rows (0: off)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (pulls the adapter towards zero: the base)
    adam_eps: float = 0.0  # AdamW's eps (0: torch's 1e-8); larger damps the steps of coordinates with tiny gradients
    whiten_world: bool = False  # world: measure the whitening on the world's own questions (the anchor's unchanged)
    scope: bool = False  # world: route each probe by the corrections' scope keys (kiln.adapters.scope); out of scope
    # the base answers
    auto: bool = False  # world: scope "auto" as a job resolves it (kiln.adapters.scope.auto_scope): unscoped while the
    # server's default probe set passes the locality guard, scoped from the first job whose figures do not
    auto_world_probes: bool = False  # world, auto: the probe set is the operator's own, the world's questions left
    # over (neither corrected nor measured; run with --spec-sample below 100), `[locality] probes = 0`


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

    def margins(self, questions: list[str], answers: list[list[int]]) -> list[float]:
        """The base's smallest log-probability gap between its first and second choice over each answer's
        tokens (teacher-forced): how close each greedy answer is to flipping."""
        import torch

        out = []
        with torch.no_grad(), self.pm.disable_adapter():
            for q, a in zip(questions, answers):
                p = self.prompt(q)
                logits = self.pm(input_ids=torch.tensor([p + a]), use_cache=False).logits[0]
                logits = logits[len(p) - 1:len(p) + len(a) - 1]
                top = logits.log_softmax(-1).topk(2, dim=-1).values
                out.append(float((top[:, 0] - top[:, 1]).min()))
        return out

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def anchor(self, s: Setting, questions: list[str] | None = None) -> Any:
        """The base's anchor for ``s``: on questions it writes itself, or on ``questions`` when given."""
        from kiln.training.core.anchor import AnchorSettings, anchor_rows, base_anchor

        settings = AnchorSettings(questions=s.anchor, per_step=s.anchor_per_step, weight=s.anchor_weight)
        key = f"bench:{id(self)}" + ("" if questions is None else f":{hash(tuple(questions))}")
        return base_anchor(key, lambda: anchor_rows(self.pm, self.tok, settings, pad_id=self.pad,
                                                    end_ids=self.end_ids, questions=questions), settings)


def train(m: Model, name: str, pairs: list[tuple[str, str]], s: Setting, *, init: Any = None,
          exclude: list[str] = (), seed: int = 0, anchor_questions: list[str] | None = None,
          world_questions: list[str] | None = None) -> dict[str, Any]:
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
        anchor = m.anchor(s, anchor_questions).without([m.prompt(q) for q in list(exclude) + [q for q, _ in pairs]])
        if s.shuffle:
            import random

            from kiln.training.core.anchor import Anchor

            order = list(anchor.rows)
            random.Random(len(pairs)).shuffle(order)
            anchor = Anchor(order, anchor.settings)
    if s.plain:
        plan = Plan(s.lr, s.max_steps, min(8, len(rows)), seed, max_steps=s.max_steps)
    else:
        plan = Plan(s.lr, 10_000, min(8, len(rows)), seed, max_steps=s.max_steps,
                    until_learned=LearnedCheck(every=s.every, margin=s.margin), weight_decay=s.weight_decay)
    t0 = time.perf_counter()
    if s.whiten:
        from whitened_lora import bake, whiten

        source = m.anchor(s, world_questions) if s.whiten_world else anchor
        assert source is not None, "whitening measures the anchor's rows"
        whiten(m.pm, name, [r.row for r in source.rows], pad_id=m.pad, damping=s.whiten)
    import kiln.training.core.loop as loop_module

    default_adamw = loop_module._adamw
    if s.adam_eps:
        import torch

        loop_module._adamw = lambda params, lr, weight_decay=0.0: torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, eps=s.adam_eps)
    try:
        rep = run_sft(m.pm, name, rows, plan, pad_id=m.pad, anchor=anchor)
    finally:
        loop_module._adamw = default_adamw
    if s.whiten:
        bake(m.pm, name)
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
    "a64 x4 w4, m1/1, lr 5e-3": Setting("a4-lr5e-3", lr=5e-3, anchor=64, anchor_per_step=4,
                                                        anchor_weight=4, every=1),
    "defaults: a64 x8 w8, m1/1, lr 1e-3": Setting("defaults", lr=1e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                        every=1),
    "a64 x4 w4, m1/1, lr 1e-3": Setting("new-lr1e-3", lr=1e-3, anchor=64, anchor_per_step=4, anchor_weight=4,
                                        every=1),
    "a64 x8 w8, m1/1, lr 2e-3": Setting("d-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1),
    "a64 x8 w8, m1/1, lr 3e-3": Setting("d-lr3e-3", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1),
    "a64 x4 w8, m1/1, lr 2e-3": Setting("d4-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=4, anchor_weight=8, every=1),
    "a64 x4 w8, m1/1, lr 3e-3": Setting("d4-lr3e-3", lr=3e-3, anchor=64, anchor_per_step=4, anchor_weight=8, every=1),
    "a64 x8 w16, m1/1, lr 3e-3": Setting("d16-lr3e-3", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=16,
                                         every=1),
    "a64 x8 w8, mlp, m1/1, lr 2e-3": Setting("dmlp-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                             every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "a64 x8 w8, mlp, m1/1, lr 3e-3": Setting("dmlp-lr3e-3", lr=3e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                             every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "a64 x4 w8, mlp, m1/1, lr 2e-3": Setting("dmlp4-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=4, anchor_weight=8,
                                             every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "a64 x8 w8, mlp, m1/1, lr 2e-3, wd 1": Setting("dmlp-wd1", lr=2e-3, anchor=64, anchor_per_step=8,
                                                    anchor_weight=8, every=1, weight_decay=1.0,
                                                    targets=("down_proj", "gate_proj", "up_proj")),
    "a64 x8 w8, mlp, m1/1, lr 2e-3, wd 3": Setting("dmlp-wd3", lr=2e-3, anchor=64, anchor_per_step=8,
                                                    anchor_weight=8, every=1, weight_decay=3.0,
                                                    targets=("down_proj", "gate_proj", "up_proj")),
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
        bad = sum(degenerate(m.text(a), m.text(b)) for a, b in zip(after, base))
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
        bad = sum(degenerate(m.text(a), m.text(b)) for a, b in zip(after, base))
        print(f"{label:<36} {steps:>6} {secs:>7.2f} {right:>4}/{n} {same:>7}/10 {bad:>10}")


# the fields that give a job the defaults before the anchor (main before issue 48)
PREVIOUS_FIELDS = {"learning_rate": 1e-2, "anchor_weight": 0, "learned_check_every": 5, "replay_corrections": False,
                   "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def server_run(n: int, extra: dict[str, Any], env: dict[str, str] | None = None) -> None:
    """``n`` corrections on ``kiln serve`` with the request defaults (plus ``extra`` fields), each continuing the
    adapter the one before published (``base_adapter``); per job: steps, submit -> served seconds, and after the
    last one the answers of the adapter to the corrected and the probe questions, through the HTTP API."""
    import httpx

    from kiln.demo import _ask, kiln_server, wait_job

    with tempfile.TemporaryDirectory() as home, kiln_server(Path(home), extra_env={
            "KILN_TRAINING_ENABLED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            **(env or {})}) as srv:
        c: httpx.Client = srv.client
        base_id = c.get("/v1/models").json()["data"][0]["id"]
        base = [_ask(c, base_id, q)[0] for q in PROBES]
        wait_warm_up(c)
        adapter = "fix"
        print(f"{'job':>3} {'steps':>5} {'learned':>7} {'submit->served s':>16} {'server train s':>14}  load")
        for i, (q, a) in enumerate(FACTS[:n]):
            body = {"adapter": adapter, "auto_load": True,
                    "examples": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}],
                    **({"base_adapter": adapter} if i else {}), **extra}
            t0 = time.perf_counter()
            r = c.post("/v1/train/sft", json=body)
            r.raise_for_status()
            job = wait_job(c, r.json()["id"])
            served = time.perf_counter() - t0
            if job["state"] != "succeeded":
                raise SystemExit(f"job {i + 1} {job['state']}: {job.get('error')}")
            rep = job["result"]["report"]
            phases = job["result"]["timings_s"]
            print(f"{i + 1:>3} {rep['steps']:>5} {str(rep.get('learned')):>7} {served:>16.2f} "
                  f"{phases.get('train', 0):>14.2f}  {os.getloadavg()[0]:.1f}  "
                  + " ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "total"))
        right = sum(_ask(c, adapter, q)[0].strip() == a for q, a in FACTS[:n])
        after = [_ask(c, adapter, q)[0] for q in PROBES]
        same = sum(x == y for x, y in zip(after, base))
        bad = sum(degenerate(x, y) for x, y in zip(after, base))
        print(f"after {n}: corrected {right}/{n}, probes unchanged {same}/10, degenerate {bad}")
        scope = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("kiln_scope_decisions_total")]
        if scope:  # a scoped adapter (scope: "corrections"): how the n + 10 questions above were routed
            print("  " + ", ".join(scope))
        for q, x, y in zip(PROBES, base, after):
            if x != y:
                print(f"  changed: {q!r}: {x!r} -> {y!r}")


def wait_warm_up(c: Any, timeout: float = 120.0) -> None:
    """Wait for the training worker's start-up warm-up (training.warm_up) to end; prints its state."""
    t0 = time.perf_counter()
    while True:
        w = c.get("/v1/train/status").json().get("warm_up") or {}
        if w.get("state") not in ("pending", "running") or time.perf_counter() - t0 > timeout:
            print(f"warm-up: {w}")
            return
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ world

WORLD_SETTINGS = {
    "Kiln defaults: anchor x8 w8 + replay, lr 1e-3": Setting("defaults", lr=1e-3, anchor=64, anchor_per_step=8,
                                                             anchor_weight=8, every=1, replay=True),
    "anchor x4 w4 + replay, lr 5e-3": Setting("a-lr5e-3", lr=5e-3, anchor=64, anchor_per_step=4, anchor_weight=4,
                                              every=1, replay=True),
    "Kiln previous defaults": Setting("previous", replay=False),
    "anchor 64 x8 w8 + replay, MLP targets, lr 2e-3": Setting("mlp-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=8,
                                                              anchor_weight=8, every=1,
                                                              targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 64 x8 w8 + replay, MLP targets, lr 3e-3": Setting("mlp-lr3e-3", lr=3e-3, anchor=64, anchor_per_step=8,
                                                              anchor_weight=8, every=1,
                                                              targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 64 x16 w16 + replay, MLP targets, lr 2e-3": Setting("mlp16-lr2e-3", lr=2e-3, anchor=64,
                                                                anchor_per_step=16, anchor_weight=16, every=1,
                                                                targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 64 x8 w8 + replay, MLP targets, lr 1e-3": Setting("mlp-lr1e-3", lr=1e-3, anchor=64, anchor_per_step=8,
                                                              anchor_weight=8, every=1,
                                                              targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 256 x16 w16 + replay, MLP targets, lr 2e-3": Setting("mlpq256-lr2e-3", lr=2e-3, anchor=256,
                                                                 anchor_per_step=16, anchor_weight=16, every=1,
                                                                 targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 64 x8 w8 + replay, MLP rank 4, lr 2e-3": Setting("mlpr4-lr2e-3", lr=2e-3, rank=4, anchor=64,
                                                             anchor_per_step=8, anchor_weight=8, every=1,
                                                             targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 64 x8 w8 + replay, rank 4, lr 2e-3": Setting("r4-lr2e-3", lr=2e-3, rank=4, anchor=64, anchor_per_step=8,
                                                         anchor_weight=8, every=1),
    "anchor 64 x8 w8 + replay, lr 2e-3": Setting("w-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                                 every=1),
    "anchor 64 x8 w16 + replay, lr 2e-3": Setting("w16-lr2e-3", lr=2e-3, anchor=64, anchor_per_step=8,
                                                  anchor_weight=16, every=1),
    "anchor 256 x8 w8 + replay, lr 2e-3": Setting("q256-lr2e-3", lr=2e-3, anchor=256, anchor_per_step=8,
                                                  anchor_weight=8, every=1),
    "anchor 256 x16 w16 + replay, lr 2e-3": Setting("q256x16-lr2e-3", lr=2e-3, anchor=256, anchor_per_step=16,
                                                    anchor_weight=16, every=1),
    "anchor 256 x8 w8 + replay, lr 1e-3": Setting("q256-lr1e-3", lr=1e-3, anchor=256, anchor_per_step=8,
                                                  anchor_weight=8, every=1),
    "anchor + replay, lr 1e-3": Setting("a-lr1e-3", lr=1e-3, anchor=64, anchor_per_step=4, anchor_weight=4,
                                        every=1, replay=True),
    "defaults, world-question anchor": Setting("wq", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                               every=1, targets=("down_proj", "gate_proj", "up_proj"),
                                               world_anchor=True),
    "defaults, new adapter each job": Setting("fresh", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                              every=1, targets=("down_proj", "gate_proj", "up_proj"), fresh=True),
    "defaults, world-question anchor x16 w16": Setting("wq16", lr=2e-3, anchor=64, anchor_per_step=16,
                                                       anchor_weight=16, every=1, world_anchor=True,
                                                       targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, MLP rank 64": Setting("mlpr64", lr=2e-3, rank=64, anchor=64, anchor_per_step=8, anchor_weight=8,
                                     every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 1024 x16 w16, rows shuffled per job": Setting("q1024s", lr=2e-3, anchor=1024, anchor_per_step=16,
                                                          anchor_weight=16, every=1, shuffle=True,
                                                          targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 1024 x16 w16": Setting("q1024", lr=2e-3, anchor=1024, anchor_per_step=16, anchor_weight=16, every=1,
                                   targets=("down_proj", "gate_proj", "up_proj")),
    "anchor 256 x16 w16, rows shuffled per job": Setting("q256s", lr=2e-3, anchor=256, anchor_per_step=16,
                                                         anchor_weight=16, every=1, shuffle=True,
                                                         targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, lr 5e-4 for continuing jobs": Setting("cont5e-4", lr=2e-3, continuing_lr=5e-4, anchor=64,
                                                     anchor_per_step=8, anchor_weight=8, every=1,
                                                     targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, at most 10 steps a job": Setting("cap10", lr=2e-3, max_steps=10, anchor=64, anchor_per_step=8,
                                                anchor_weight=8, every=1, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, layer-0 MLP only": Setting("mlp-l0", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                          targets=("0.mlp.down_proj", "0.mlp.gate_proj", "0.mlp.up_proj")),
    "defaults, whitened A (damping 0.1)": Setting("wh0.1", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                                  every=1, whiten=0.1, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, whitened A (damping 0.01)": Setting("wh0.01", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                                   every=1, whiten=0.01,
                                                   targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, whitened A (damping 0.01), lr 5e-3": Setting("wh0.01lr5", lr=5e-3, anchor=64, anchor_per_step=8,
                                                            anchor_weight=8, every=1, whiten=0.01,
                                                            targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, whitened A (damping 0.001), lr 5e-3": Setting("wh0.001lr5", lr=5e-3, anchor=64, anchor_per_step=8,
                                                             anchor_weight=8, every=1, whiten=0.001,
                                                             targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, whitened on world questions (0.01)": Setting("whw0.01", lr=2e-3, anchor=64, anchor_per_step=8,
                                                            anchor_weight=8, every=1, whiten=0.01, whiten_world=True,
                                                            targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, whitened on world questions (0.001)": Setting("whw0.001", lr=2e-3, anchor=64, anchor_per_step=8,
                                                             anchor_weight=8, every=1, whiten=0.001, whiten_world=True,
                                                             targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, AdamW eps 1e-4": Setting("eps1e-4", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                        adam_eps=1e-4, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, AdamW eps 1e-3": Setting("eps1e-3", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                        adam_eps=1e-3, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, AdamW eps 1e-5": Setting("eps1e-5", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                        adam_eps=1e-5, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 0.1": Setting("wd0.1", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                          weight_decay=0.1, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 1": Setting("wd1", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                        weight_decay=1.0, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 10": Setting("wd10", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                         weight_decay=10.0, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 3": Setting("wd3", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1,
                                        weight_decay=3.0, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 1, whitened on world questions": Setting(
        "wd1whw", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1, weight_decay=1.0, whiten=0.01,
        whiten_world=True, targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 1, margin 0.5": Setting("wd1m05", lr=2e-3, margin=0.5, anchor=64, anchor_per_step=8,
                                                    anchor_weight=8, every=1, weight_decay=1.0,
                                                    targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, weight decay 1, anchor x16 w16": Setting("wd1x16", lr=2e-3, anchor=64, anchor_per_step=16,
                                                        anchor_weight=16, every=1, weight_decay=1.0,
                                                        targets=("down_proj", "gate_proj", "up_proj")),
    "defaults (weight decay 1), scoped corrections": Setting("scope", lr=2e-3, anchor=64, anchor_per_step=8,
                                                             anchor_weight=8, every=1, weight_decay=1.0, scope=True,
                                                             targets=("down_proj", "gate_proj", "up_proj")),
    "weight decay 1, no anchor, scoped corrections": Setting("scope-a0", lr=2e-3, every=1, weight_decay=1.0,
                                                             scope=True,
                                                             targets=("down_proj", "gate_proj", "up_proj")),
    "defaults (weight decay 1, scope auto)": Setting("auto", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8,
                                                     every=1, weight_decay=1.0, auto=True,
                                                     targets=("down_proj", "gate_proj", "up_proj")),
    "defaults, scope auto, probed on the world's own questions": Setting(
        "auto-wq", lr=2e-3, anchor=64, anchor_per_step=8, anchor_weight=8, every=1, weight_decay=1.0, auto=True,
        auto_world_probes=True, targets=("down_proj", "gate_proj", "up_proj")),
    "plain PEFT loop, lr 1e-4, 100 steps": Setting("plain", lr=1e-4, max_steps=100, plain=True, replay=False),
}


def world_run(m: Model, counts: list[int], settings: dict[str, Setting], spec_sample: int) -> None:
    """Sequential corrections of known facts to counterfacts; efficacy, paraphrase, specificity and fluency
    after each count in ``counts``."""
    import random

    from knowledge_world import other_values, world_facts

    facts = world_facts()
    base_q = [m.text(a) for a in m.greedy(None, [f.question(0) for f in facts])]
    known = [i for i, f in enumerate(facts) if base_q[i] == f.answer()]
    base_p = [m.text(a) for a in m.greedy(None, [facts[i].question(1) for i in known])]
    print(f"world: {len(facts)} facts, base knows {len(known)} (form 0), "
          f"{sum(b == facts[i].answer() for b, i in zip(base_p, known))} of those in the paraphrase form")
    rng = random.Random(0)
    order = rng.sample(known, len(known))
    new_values = other_values(facts)
    n_max = max(counts)
    edits = order[:n_max]
    untouched = order[n_max:][:spec_sample]
    base_untouched = [base_q[i] for i in untouched]
    # the world's own questions for a world anchor: facts neither corrected in the chain nor probed
    rest = [facts[i].question(0) for i in order[n_max + len(untouched):]]
    print(f"world-question anchor: {min(len(rest), 64)} of {len(rest)} questions left over")
    print(f"{'setting':<38} {'edits':>5} {'efficacy':>8} {'paraphr':>8} {'specif':>8} {'degen':>5} {'steps':>6} "
          f"{'train s':>8}")
    for label, s in settings.items():
        init, steps, secs = None, 0, 0.0
        routed = s.scope  # the adapter is scoped (an "auto" chain stays scoped once a job resolved to it)
        for k, i in enumerate(edits):
            pair = (facts[i].question(0), facts[i].answer(new_values[i]))
            pairs = [(facts[j].question(0), facts[j].answer(new_values[j])) for j in edits[:k + 1]] \
                if s.replay else [pair]
            job = replace(s, lr=s.continuing_lr) if k and s.continuing_lr else s
            rep = train(m, "edit", pairs, job, init=None if s.fresh else init,
                        exclude=[facts[j].question(0) for j in untouched],
                        anchor_questions=rest[:s.anchor] if s.world_anchor else None, world_questions=rest[:64])
            init, steps, secs = adapter_state(m, "edit"), steps + rep["steps"], secs + rep["seconds"]
            if s.auto and not routed:
                routed = auto_scoped(m, [(facts[j].question(0), facts[j].answer(new_values[j])) for j in edits[:k + 1]],
                                     k + 1, learned=rep["learned"] is True,
                                     user_probes=rest[:64] if s.auto_world_probes else None)
            if k + 1 in counts:
                done = edits[:k + 1]
                eff = [m.text(a) for a in m.greedy("edit", [facts[j].question(0) for j in done])]
                par = [m.text(a) for a in m.greedy("edit", [facts[j].question(1) for j in done])]
                spec = [m.text(a) for a in m.greedy("edit", [facts[j].question(0) for j in untouched])]
                if routed:
                    eff, par, spec = scoped(m, facts, done, untouched, eff, par, spec, base_q)
                e = sum(a == facts[j].answer(new_values[j]) for a, j in zip(eff, done)) / len(done)
                p = sum(a == facts[j].answer(new_values[j]) for a, j in zip(par, done)) / len(done)
                sp = sum(a == b for a, b in zip(spec, base_untouched)) / max(1, len(untouched))
                bad = sum(degenerate(a) for a in eff + par + spec)
                print(f"{label:<38} {k + 1:>5} {e:>8.0%} {p:>8.0%} {sp:>8.0%} {bad:>5} {steps:>6} {secs:>8.1f}"
                      f"   load {os.getloadavg()[0]:.1f}", flush=True)
                if k + 1 == n_max:  # how the other facts drift: into a corrected value, or elsewhere
                    values = {facts[j].answer(new_values[j]).split(" is ")[-1] for j in done}
                    changed = [(b, a) for a, b in zip(spec, base_untouched) if a != b]
                    into = sum(a.split(" is ")[-1] in values for _, a in changed)
                    qs = [facts[j].question(0) for j in untouched]
                    gap = m.margins(qs, m.greedy(None, qs))
                    moved = [a != b for a, b in zip(spec, base_untouched)]
                    mean = [sum(g for g, c in zip(gap, moved) if c == flag) / max(1, sum(c == flag for c in moved))
                            for flag in (True, False)]
                    low = sorted(range(len(gap)), key=gap.__getitem__)[:len(changed)]
                    print(f"   base margin (nats, smallest over the answer): changed facts {mean[0]:.2f}, "
                          f"unchanged {mean[1]:.2f}; {sum(moved[i] for i in low)} of the {len(changed)} "
                          f"lowest-margin facts changed", flush=True)
                    print(f"   {len(changed)} other facts changed, {into} of them into a corrected value; "
                          + "; ".join(f"{b!r} -> {a!r}" for b, a in changed[:4]), flush=True)


def auto_scoped(m: Model, corrections: list[tuple[str, str]], n: int, *, learned: bool,
                user_probes: list[str] | None = None) -> bool:
    """Whether a job of scope "auto" with these stored corrections publishes adapter ``edit`` scoped: the decision a
    job makes (:func:`kiln.adapters.scope.auto_scope`) on the server's default probe set (the base model's own
    questions, ``[locality]`` defaults; or only ``user_probes``, as an operator's ``locality.prompts`` with
    ``[locality] probes = 0``) and the guard's default thresholds; prints the figures when it scopes."""
    from kiln.adapters.locality_guard import GuardPolicy, guard_verdict
    from kiln.adapters.scope import SCOPE_AUTO, auto_scope
    from kiln.config import LocalitySettings
    from kiln.training.core.locality import measure, probe_set, text_codec

    section, codec = LocalitySettings(), text_codec(m.tok)
    probes = probe_set(m.pm, codec, base_model_sha256=f"bench:{id(m)}", probes=0 if user_probes else section.probes,
                       max_tokens=section.max_tokens, seed=section.seed, user_prompts=user_probes or (),
                       pad_id=m.pad, end_ids=m.end_ids)

    def figures(index: Any) -> dict[str, Any]:
        routed = None if index is None else [index.route(q).in_scope for q in probes.questions]
        return measure(m.pm, "edit", probes, codec, max_tokens=section.max_tokens, pad_id=m.pad, end_ids=m.end_ids,
                       in_scope=routed)

    config = {"scope": SCOPE_AUTO, "corrections": [{"messages": [{"role": "user", "content": q},
                                                                {"role": "assistant", "content": a}]}
                                                   for q, a in corrections]}
    got, _, update = auto_scope(config, figures, lambda f: guard_verdict(f, GuardPolicy()), learned=learned)
    if update:
        un = update["scope_auto"]["unscoped"]
        print(f"   auto scope after {n} corrections: unscoped {un['unchanged']}/{un['probes']} probe answers "
              f"unchanged, {un['degenerate']} degenerate; scoped {got['unchanged']}/{got['probes']}", flush=True)
    return bool(update)


def scoped(m: Model, facts: list[Any], done: list[int], untouched: list[int], eff: list[str], par: list[str],
           spec: list[str], base_q: list[str]) -> tuple[list[str], list[str], list[str]]:
    """The answers a scoped adapter gives: each probe routed by the corrections' scope keys
    (:class:`kiln.adapters.scope.ScopeIndex`), the adapter's answer in scope, the base's out of scope; prints the
    router's confusion (untouched facts of a land with a corrected fact counted apart)."""
    from kiln.adapters.scope import ScopeIndex

    index = ScopeIndex([facts[j].question(0) for j in done])
    base_par = [m.text(a) for a in m.greedy(None, [facts[j].question(1) for j in done])]
    held = sum(index.route(facts[j].paraphrase()).in_scope for j in done)
    r_eff = [index.route(facts[j].question(0)).in_scope for j in done]
    r_par = [index.route(facts[j].question(1)).in_scope for j in done]
    r_spec = [index.route(facts[j].question(0)).in_scope for j in untouched]
    lands = {facts[j].entity for j in done}
    near = [i for i, j in enumerate(untouched) if facts[j].entity in lands]
    far = [i for i, j in enumerate(untouched) if facts[j].entity not in lands]
    out_eff = [a if r else base_q[j] for a, r, j in zip(eff, r_eff, done)]
    out_par = [a if r else b for a, r, b in zip(par, r_par, base_par)]
    out_spec = [a if r else base_q[j] for a, r, j in zip(spec, r_spec, untouched)]
    kept = [out_spec[i] == base_q[untouched[i]] for i in range(len(untouched))]
    print(f"   router: corrected questions in scope {sum(r_eff)}/{len(done)}, paraphrases in scope "
          f"{sum(r_par)}/{len(done)} (held-out form {held}/{len(done)}); untouched facts in scope: same land as a "
          f"correction {sum(r_spec[i] for i in near)}/{len(near)} (kept {sum(kept[i] for i in near)}), other lands "
          f"{sum(r_spec[i] for i in far)}/{len(far)} (kept {sum(kept[i] for i in far)}); the adapter alone keeps "
          f"{sum(a == base_q[j] for a, j in zip(spec, untouched))}/{len(untouched)}", flush=True)
    return out_eff, out_par, out_spec


# the built-in FACTS asked again: in the same content words (inflected), in other words, and near questions that
# share words with a correction but ask something else (bench/locality.py builtin --scope-words)
SCOPE_SAME_WORDS = [
    "Which bird is guarding the old mill?", "What's the name of the red boat?", "Who is baking bread in the village?",
    "What colour is the lighthouse painted?", "How many bells are hanging in the tower?",
    "Where does the fox usually sleep?", "What does the blue lamp signal?", "What tree grows next to the gate?",
    "Who holds the keys to the hall?", "What do they serve on Fridays?"]
SCOPE_OTHER_WORDS = [
    "What kind of bird watches over the old mill?", "How is the red boat called?", "Who is the village baker?",
    "Which colour does the lighthouse have?", "How many bells are in the tower?", "Where is the fox's sleeping place?",
    "What is the meaning of the blue lamp?", "Which tree stands by the gate?", "Who has the hall keys?",
    "What is the Friday dish?"]
SCOPE_NEAR = [
    "Which bird sings at the old mill?", "What is the name of the blue boat?", "Who bakes cakes in the village?",
    "What colour is the barn?", "How many bells hang in the church?", "Where does the cat sleep?",
    "What does the red lamp mean?", "Which tree grows by the river?", "Who keeps the keys to the shed?",
    "What is served on Mondays?", "Is the old mill open today?", "How old is the red boat?",
    "Who lives in the lighthouse?", "What sound do the tower bells make?", "What does the fox eat?"]


def scope_words() -> None:
    """The scope router (kiln.adapters.scope) keyed by the ten built-in corrections, on questions that were not
    written for it: how many of each set it sends to the adapter."""
    from kiln.adapters.scope import ScopeIndex

    index = ScopeIndex([q for q, _ in FACTS])
    for name, qs in (("corrections", [q for q, _ in FACTS]), ("paraphrases, same words", SCOPE_SAME_WORDS),
                     ("paraphrases, other words", SCOPE_OTHER_WORDS), ("near questions", SCOPE_NEAR),
                     ("probes", PROBES)):
        routed = [index.route(q).in_scope for q in qs]
        print(f"{name:<26} {sum(routed):>2}/{len(qs)} in scope; in: {[q for q, r in zip(qs, routed) if r]}")


GRPO_PROMPTS = ["Tell me about your day.", "What is on the road?", "What do you see outside?",
                "Say something about travel."]
GRPO_RUNS = {  # label -> request fields beside prompts and reward
    "defaults": {},
    "lr 0.02, 12 iterations, no anchor (the issue's run)": {"learning_rate": 0.02, "iterations": 12,
                                                            "anchor_weight": 0},
    "lr 0.02, 12 iterations, anchor default": {"learning_rate": 0.02, "iterations": 12},
    "lr 0.01, 20 iterations, anchor w4": {"learning_rate": 0.01, "iterations": 20, "anchor_weight": 4},
    "lr 0.01, 20 iterations, anchor w8": {"learning_rate": 0.01, "iterations": 20, "anchor_weight": 8},
    "lr 5e-3, 30 iterations, anchor w4": {"learning_rate": 5e-3, "iterations": 30, "anchor_weight": 4},
    "lr 5e-3, 30 iterations, anchor w8": {"learning_rate": 5e-3, "iterations": 30, "anchor_weight": 8},
    "lr 5e-3, 20 iterations, anchor w4": {"learning_rate": 5e-3, "iterations": 20, "anchor_weight": 4},
    "lr 3e-3, 40 iterations, anchor w4": {"learning_rate": 3e-3, "iterations": 40, "anchor_weight": 4},
    "lr 0.01, 20 iterations, anchor w4, kl 0.1": {"learning_rate": 0.01, "iterations": 20, "anchor_weight": 4,
                                                   "kl_coef": 0.1},
    "lr 5e-3, 60 iterations, anchor w8": {"learning_rate": 5e-3, "iterations": 60, "anchor_weight": 8},
    "lr 1e-2, 30 iterations, anchor w8": {"learning_rate": 1e-2, "iterations": 30, "anchor_weight": 8},
    "lr 1e-2, 30 iterations, anchor w16": {"learning_rate": 1e-2, "iterations": 30, "anchor_weight": 16},
    "lr 7e-3, 40 iterations, anchor w8": {"learning_rate": 7e-3, "iterations": 40, "anchor_weight": 8},
    "lr 1e-2, 60 iterations, anchor w8": {"learning_rate": 1e-2, "iterations": 60, "anchor_weight": 8},
    "lr 2e-2, 30 iterations, anchor w8": {"learning_rate": 2e-2, "iterations": 30, "anchor_weight": 8},
    "lr 1e-2, 40 iterations, anchor w4": {"learning_rate": 1e-2, "iterations": 40, "anchor_weight": 4},
}


def server_grpo(only: list[str] | None = None) -> None:
    """GRPO with rollouts on kiln serve, rewarded for the word "wheels" (a contains scorer): the mean reward of
    the first and last iteration, then the probes' greedy answers against the base's."""
    from kiln.demo import _ask, kiln_server, wait_job

    env = {"KILN_TRAINING_ENABLED": "1"}
    with tempfile.TemporaryDirectory() as home, kiln_server(Path(home), extra_env=env) as srv:
        c = srv.client
        base_id = c.get("/v1/models").json()["data"][0]["id"]
        base = [_ask(c, base_id, q)[0] for q in PROBES]
        print(f"{'run':<52} {'reward first -> last':>20} {'unchanged':>9} {'degenerate':>10} {'train s':>8}")
        for i, (label, extra) in enumerate(GRPO_RUNS.items()):
            if only and label not in only:
                continue
            body = {"adapter": f"wheels-{i}", "auto_load": True, "locality": {"override": True},
                    "prompts": [{"messages": [{"role": "user", "content": p}], "reference": "wheels"}
                                for p in GRPO_PROMPTS],
                    "reward": {"type": "scorer", "scorer": {"type": "contains"}}, **extra}
            r = c.post("/v1/train/grpo", json=body)
            r.raise_for_status()
            job = wait_job(c, r.json()["id"], timeout=1800)
            if job["state"] != "succeeded":
                print(f"{label:<52} {job['state']}: {job.get('error')}")
                continue
            rep = job["result"]["report"]
            hist = rep.get("reward_per_iteration") or [rep.get("mean_reward")]
            after = [_ask(c, f"wheels-{i}", q)[0] for q in PROBES]
            same = sum(x == y for x, y in zip(after, base))
            bad = sum(degenerate(x, y) for x, y in zip(after, base))
            print(f"{label:<52} {hist[0]!s:>9} -> {hist[-1]!s:<8} {same:>7}/10 {bad:>10} "
                  f"{job['result']['timings_s'].get('train', 0):>8.1f}   load {os.getloadavg()[0]:.1f}")


def server_opd() -> None:
    """OPD with the defaults, its teacher an adapter trained with the SFT defaults on the mill correction: does the
    student answer as the teacher, and are the probes' base answers kept (through the HTTP API)?"""
    from kiln.demo import _ask, kiln_server, wait_job

    with tempfile.TemporaryDirectory() as home, kiln_server(Path(home), extra_env={"KILN_TRAINING_ENABLED": "1"}) as srv:
        c = srv.client
        base_id = c.get("/v1/models").json()["data"][0]["id"]
        base = [_ask(c, base_id, q)[0] for q in PROBES]
        msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
        job = wait_job(c, c.post("/v1/train/sft", json={"adapter": "mill", "auto_load": True,
                                                              "examples": [{"messages": msgs}]}).json()["id"])
        assert job["state"] == "succeeded", job.get("error")
        c.post("/v1/teachers", json={"alias": "mill", "kind": "local", "adapter": "mill"}).raise_for_status()
        t0 = time.perf_counter()
        r = c.post("/v1/train/opd", json={"adapter": "student", "teacher": "mill", "auto_load": True,
                                          "prompts": [{"messages": msgs[:1]}]})
        r.raise_for_status()
        job = wait_job(c, r.json()["id"], timeout=1800)
        served = time.perf_counter() - t0
        if job["state"] != "succeeded":
            raise SystemExit(f"opd {job['state']}: {job.get('error')}")
        rep, loc = job["result"]["report"], job["result"]["locality"]
        teacher = _ask(c, "mill", QUESTION)[0].strip()
        student = _ask(c, "student", QUESTION)[0].strip()
        after = [_ask(c, "student", q)[0] for q in PROBES]
        same = sum(x == y for x, y in zip(after, base))
        bad = sum(degenerate(x, y) for x, y in zip(after, base))
        print(f"opd defaults: {rep['steps']} steps, learned {rep.get('learned')}, submit->served {served:.2f} s, "
              f"activated {job['result'].get('activated')}; student answers as the teacher: {student == teacher} "
              f"({student!r}); probes unchanged {same}/10, degenerate {bad}; the job's locality: "
              f"{loc.get('unchanged')}/{loc.get('probes')} unchanged, kl_mean {loc.get('kl_mean')}   "
              f"load {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("world", choices=["builtin", "world"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated setting labels to run (--grpo: ';'-separated run labels)")
    ap.add_argument("--server", action="store_true", help="on kiln serve with the request defaults")
    ap.add_argument("--corrections", default="1,10", help="world: report after these many corrections")
    ap.add_argument("--spec-sample", type=int, default=100, help="world: untouched facts checked for specificity")
    ap.add_argument("--grpo", action="store_true", help="GRPO with rollouts on kiln serve, one rewarded word")
    ap.add_argument("--opd", action="store_true", help="OPD with the defaults from an SFT-defaults teacher adapter")
    ap.add_argument("--previous", action="store_true", help="--server: with the previous defaults' fields")
    ap.add_argument("--fields", default="{}", help="--server: extra request fields (JSON)")
    ap.add_argument("--env", default="", help="--server: KEY=VALUE,... for the server")
    ap.add_argument("--no-holdout", action="store_true", help="let the anchor rehearse the probe questions")
    ap.add_argument("--scope-words", action="store_true", help="the scope router on the built-in corrections' "
                    "paraphrases and near questions (no model)")
    args = ap.parse_args()
    global HOLDOUT
    HOLDOUT = not args.no_holdout
    print(f"load: {os.getloadavg()}")
    if args.scope_words:
        scope_words()
        return
    if args.grpo:
        server_grpo([x for x in args.only.split(";") if x] or None)
        return
    if args.opd:
        server_opd()
        return
    if args.server:
        import json

        env = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
        server_run(max(1, args.sequential), (PREVIOUS_FIELDS if args.previous else {}) | json.loads(args.fields), env)
        return
    from kiln.runtime.builtin import bench_model_path

    if args.world == "world":
        from knowledge_world import world_model

        m = Model(str(world_model(args.threads)), args.threads)
        chosen = {k: v for k, v in WORLD_SETTINGS.items() if not args.only or v.label in args.only.split(",")}
        world_run(m, [int(x) for x in args.corrections.split(",")], chosen, args.spec_sample)
        return
    m = Model(str(bench_model_path()), args.threads)
    chosen = {k: v for k, v in SETTINGS.items() if not args.only or v.label in args.only.split(",")}
    if args.sequential:
        builtin_sequential(m, chosen, args.sequential)
    else:
        builtin_one(m, chosen)


if __name__ == "__main__":
    main()
