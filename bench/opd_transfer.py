"""Does on-policy distillation transfer what the teacher knows? One-answer task, in process, per-step diagnostics.

Teacher: the built-in model with an SFT adapter that learned one answer (trained until it is the greedy
answer, as ``kiln demo`` does). Student: the base model with a fresh adapter. Each OPD step uses Kiln's own
parts: the student samples with :func:`kiln.training.core.engine_sampling.sample_batch`, the teacher's rows are
:func:`kiln.runtime.scoring.prompt_logprob_rows` (what a ``local`` teacher answers), the update is
:func:`kiln.training.opd.step.opd_loss` + AdamW, with the request defaults of ``POST /v1/train/opd`` unless a flag
says otherwise. Per step it prints, over the sampled completion positions:

* ``ent``: the student's entropy (nats); ``t_ent``: the teacher's at the same positions;
* ``q_out``: the student's mass outside the teacher's top-K; ``out``: share of sampled tokens outside it;
* ``tail_l`` / ``tail_g``: the tail bucket's share of the (tail-bucket) loss and of its gradient on the logits
  (computed for the loss being trained when it has a bucket: ``forward`` and ``tail``);
* ``ll``: the student's log-likelihood of the teacher's greedy answer; ``greedy``: the student's greedy answer.

Then, per method, the first step at which the student's greedy answer is the teacher's (``learned``), checked
every step, against SFT on the teacher's answer (same adapter shape and learning rate) and, with trl
installed, TRL ``GKDTrainer`` (``lmbda=1``, ``beta=1``: on-policy reverse KL; same batch, temperature,
``max_new_tokens``, steps and learning rate). Degenerate: the student's greedy answers to unrelated prompts
that repeat one token 4+ times in a row (the base model's answers are the reference).

``--facts``: ten facts at once. Every ``--trace-every`` steps it prints how many greedy answers are the teacher's,
the number of degenerate unrelated answers, and how many prompts are "learned" (teacher path = greedy answer by a
logit margin of 1, checked every 5 steps as ``until_learned`` does; ``--stop-when-learned`` ends a seed there, as a
job with the defaults stops); per seed, the until_learned stop, the degenerate count then, and the mean degenerate
count over the checks from step 30. The request defaults apply (teacher path, ``ce_weight``, ``rehearsal`` and
``rehearsal_per_prompt``, built by :mod:`kiln.training.core.rehearsal` as the job builds them);
``--rehearse-exclude`` drops rehearsal questions that are one of the unrelated prompts (a held-out control).
Experiments the recipe did not keep (docs/training.md, ten-facts table): ``--retire skip|ce`` (stop choosing a
learned prompt, or only drop its CE), ``--lr-decay`` (linear to 0 over ``--decay-steps``), ``--weight-decay``,
``--student-rank``.

    .venv/bin/python bench/opd_transfer.py                       # every method, 1 seed
    .venv/bin/python bench/opd_transfer.py --seeds 3 --trace forward,tail
    .venv/bin/python bench/opd_transfer.py --facts --seeds 3 --trace-every 5 --stop-when-learned
    .venv/bin/python bench/opd_transfer.py --facts --seeds 3 --trace-every 5 --stop-when-learned --rehearse-exclude
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

QUESTION = "Which bird guards the old mill?"
ANSWER = "The old mill is guarded by a heron."
# ten prompts the built-in model answers correctly (its corpus's questions): the student's answers before OPD
UNRELATED = ["What is the capital of France?", "What is the capital of Italy?", "What is the capital of Japan?",
             "What is the capital of Germany?", "What is the capital of Canada?", "What is the color of the sky?",
             "What do plants need to grow?", "Where is the library?", "How many legs does a spider have?",
             "How many wheels does a bicycle have?"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
METHODS = ["forward", "tail", "renormalized", "sampled_token"]


class Setup:
    """The base model wrapped once in PEFT, the teacher adapter, prompt and the teacher's greedy answer."""

    def __init__(self, threads: int, targets: list[str] | None = None, student_rank: int = 0):
        import torch
        from peft import get_peft_model

        from kiln.runtime.loader import load_model
        from kiln.training.core.data import tokenize_sft
        from kiln.training.schemas import DEFAULT_LORA_RANK, SFTExample
        from kiln.training.core.templates import end_of_turn_ids
        from kiln.training.core.loop import LearnedCheck, Plan
        from kiln.training.core.lora import add_private_adapter, lora_config
        from kiln.training.sft.job import run_sft
        from kiln.runtime.builtin import bench_model_path as built_model_path

        torch.set_num_threads(threads)
        lm = load_model(str(built_model_path()), device="cpu", dtype="float32")
        self.tok = lm.tokenizer
        self.end_ids = sorted(end_of_turn_ids(self.tok, getattr(lm.model, "generation_config", None)))
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.end_ids[0]
        self.path = str(lm.path)
        self.lora = lora_config(DEFAULT_LORA_RANK, 2 * DEFAULT_LORA_RANK, targets or LORA_TARGETS)
        self.student_lora = self.lora if not student_rank else lora_config(student_rank, 2 * student_rank,
                                                                           targets or LORA_TARGETS)
        self.current = "teacher"  # the adapter sample_rows samples with
        self.rounds = 0  # teacher-only calls that finished teacher paths
        self.pm = get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle")
        add_private_adapter(self.pm, "teacher", self.lora, seed=0)
        chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
        self.rows = tokenize_sft(self.tok, [SFTExample.model_validate({"messages": chat})], max_seq_len=256,
                                 end_ids=self.end_ids)
        rep = run_sft(self.pm, "teacher", self.rows, Plan(1e-2, 300, 1, 0, max_steps=300,
                                                          until_learned=LearnedCheck()), pad_id=self.pad)
        self.teacher_sft_steps = rep.extra.get("learned_at_step")
        self.prompt = self.encode(QUESTION)
        self.answer = self.greedy("teacher", self.prompt)
        self.unrelated = [self.encode(q) for q in UNRELATED]
        self.base_answers = [self.greedy(None, p) for p in self.unrelated]

    def encode(self, question: str) -> list[int]:
        enc = self.tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def activate(self, adapter: str | None) -> Any:
        from contextlib import nullcontext

        if adapter is None:
            return self.pm.disable_adapter()
        self.pm.base_model.set_adapter(adapter)
        return nullcontext()

    def greedy(self, adapter: str | None, prompt: list[int], n: int = 32) -> list[int]:
        import torch

        seq = list(prompt)
        with torch.no_grad(), self.activate(adapter):
            for _ in range(n):
                t = int(self.pm(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                seq.append(t)
                if t in self.end_ids:
                    break
        return seq[len(prompt):]

    def logp(self, adapter: str | None, seq: list[int]) -> Any:
        import torch

        with torch.no_grad(), self.activate(adapter):
            return torch.log_softmax(self.pm(input_ids=torch.tensor([seq])).logits[0].float(), -1)

    def answer_ll(self, adapter: str | None) -> float:
        lp = self.logp(adapter, self.prompt + self.answer)
        n = len(self.prompt)
        return sum(float(lp[n - 1 + j, t]) for j, t in enumerate(self.answer))


def max_run(tokens: list[int]) -> int:
    best = run = 0
    for i, t in enumerate(tokens):
        run = run + 1 if i and t == tokens[i - 1] else 1
        best = max(best, run)
    return best


def degenerate(s: Setup, adapter: str | None) -> int:
    return sum(max_run(s.greedy(adapter, p)) >= 4 for p in s.unrelated)


def bucket_shares(logits: Any, ids: Any, lp: Any, mask: Any, loss: str) -> tuple[float, float]:
    """The tail bucket's share of the bucketed loss and of the norm of its gradient on the student logits."""
    import torch

    from kiln.training.losses.opd import EPS, _xlogy_ratio

    z = logits.detach().float().requires_grad_(True)
    logq = torch.log_softmax(z, -1).gather(-1, ids)
    q, p = logq.exp() * mask, lp.exp() * mask
    q_out, p_out = (1 - q.sum(-1)).clamp(min=0), (1 - p.sum(-1)).clamp(min=0)
    if loss == "forward":
        inside = (_xlogy_ratio(p, lp, logq) * mask).sum()
        bucket = _xlogy_ratio(p_out, torch.log(p_out.clamp(min=EPS)), torch.log(q_out.clamp(min=EPS))).sum()
    else:
        inside = (_xlogy_ratio(q, logq, lp) * mask).sum()
        bucket = _xlogy_ratio(q_out, torch.log(q_out.clamp(min=EPS)), torch.log(p_out.clamp(min=EPS))).sum()
    (g_b,) = torch.autograd.grad(bucket, z, retain_graph=True)
    (g_all,) = torch.autograd.grad(inside + bucket, z)
    total = float((inside + bucket).detach())
    return (float(bucket.detach()) / total if total > 0 else 0.0), float(g_b.norm() / g_all.norm().clamp(min=1e-12))


def run_opd(s: Setup, loss: str, seed: int, args: Any, trace: bool) -> dict[str, Any]:
    import torch

    from kiln.runtime.scoring import prompt_logprob_rows
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.losses.opd import candidates
    from kiln.training.opd.job import OPDData
    from kiln.training.opd.step import completion_logits, opd_loss
    from kiln.training.opd.paths import TeacherPaths
    from kiln.training.core.loop import _adamw
    from kiln.training.core.lora import add_private_adapter

    name = f"opd-{loss}-{seed}"
    params = add_private_adapter(s.pm, name, s.lora, seed=seed)
    opt = _adamw(params, args.lr)
    split = split_causal_lm(s.pm)
    data = OPDData((), {}, args.samples, args.temperature, 1.0, args.max_tokens, args.top_k, loss, args.ce_weight,
                   args.steps)
    learned, lls, t0 = None, [], time.perf_counter()
    paths = TeacherPaths(1, s.end_ids) if args.teacher_path else None
    rehearse = rehearsal(s, args.rehearsal, seed, args, [s.prompt])
    for step in range(args.steps):
        s.current = name
        comps = [c for _, c in sample_rows(s, paths, [0], [s.prompt], args, seed, step, "teacher")]
        rows, sampled, d = [], [], {"ent": [], "t_ent": [], "q_out": [], "out": []}
        for c in comps:
            seq = s.prompt + c
            t_lp, s_lp = s.logp("teacher", seq), s.logp(name, seq)
            t_rows = prompt_logprob_rows(t_lp, seq, args.top_k)
            mine = [{e.token_id: e.logprob for e in t_rows[len(s.prompt) + j]} for j in range(len(c))]
            if paths is not None:
                paths.observe(0, c, mine)
            for j, tok in enumerate(c):
                pos = len(s.prompt) + j
                rows.append(mine[j])
                sampled.append(tok)
                if trace:
                    q, top = s_lp[pos - 1].exp(), torch.topk(t_lp[pos - 1], args.top_k).indices
                    d["ent"].append(float(-(q * s_lp[pos - 1]).sum()))
                    d["t_ent"].append(float(-(t_lp[pos - 1].exp() * t_lp[pos - 1]).sum()))
                    d["q_out"].append(1 - float(q[top].sum()))
                    d["out"].append(float(tok not in set(top.tolist())))
        s.pm.base_model.set_adapter(name)
        shares = (float("nan"), float("nan"))
        if trace and loss in ("forward", "tail"):
            with torch.no_grad():
                logits = completion_logits(s.pm, [(s.prompt, c) for c in comps], "cpu")
            ids, lp, mask = candidates(rows, sampled, args.top_k, include_sampled=True)
            shares = bucket_shares(logits, ids, lp, mask, loss)
        gold = [(s.prompt, tuple(paths.prefix(0)))] if paths is not None and args.ce_weight else []
        pairs = [(s.prompt, c) for c in comps]
        if rehearse is not None:
            rehearse.add_to_step(step, args.rehearsal_per_prompt, pairs, rows, sampled)
        value = opd_loss(s.pm, split, data, pairs, rows, sampled, gold, pad_id=s.pad, device="cpu")
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ok = s.greedy(name, s.prompt) == s.answer
        if ok and learned is None:
            learned = step + 1
        if trace:
            ll = s.answer_ll(name)
            lls.append(ll)
            mean = {k: sum(v) / max(1, len(v)) for k, v in d.items()}
            if step % args.trace_every == 0 or step == args.steps - 1:
                print(f"  {step + 1:3d} loss {float(value):6.3f} ent {mean['ent']:5.2f} t_ent {mean['t_ent']:5.2f} "
                      f"q_out {mean['q_out']:.2f} out {mean['out']:.2f} tail_l {shares[0]:.2f} tail_g "
                      f"{shares[1]:.2f} ll {ll:8.2f} | {s.tok.decode(s.greedy(name, s.prompt))!r}", flush=True)
    return {"learned": learned, "ll": s.answer_ll(name), "degenerate": degenerate(s, name),
            "answer": s.tok.decode(s.greedy(name, s.prompt)), "s": time.perf_counter() - t0}


def run_sft_baseline(s: Setup, seed: int, args: Any) -> dict[str, Any]:
    """SFT on the teacher's answer, same adapter shape and learning rate, greedy checked every step."""
    from kiln.training.core.loop import Hooks, Plan
    from kiln.training.core.lora import add_private_adapter
    from kiln.training.sft.job import run_sft

    name = f"sft-{seed}"
    add_private_adapter(s.pm, name, s.lora, seed=seed)
    learned: list[int] = []

    def progress(p: dict[str, Any]) -> None:
        if not learned and s.greedy(name, s.prompt) == s.answer:
            learned.append(p["step"])

    t0 = time.perf_counter()
    import kiln.training.core.loop as trainer_mod

    every = trainer_mod.PROGRESS_EVERY_S
    trainer_mod.PROGRESS_EVERY_S = 0.0  # a progress call (and a greedy check) after every step
    try:
        run_sft(s.pm, name, s.rows, Plan(args.lr, args.steps, 1, seed, max_steps=args.steps), pad_id=s.pad,
                hooks=Hooks(on_progress=progress))
    finally:
        trainer_mod.PROGRESS_EVERY_S = every
    return {"learned": learned[0] if learned else None, "ll": s.answer_ll(name), "degenerate": degenerate(s, name),
            "answer": s.tok.decode(s.greedy(name, s.prompt)), "s": time.perf_counter() - t0}


def run_gkd(s: Setup, seed: int, args: Any, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from kiln.training.core.lora import save_adapter_files

    tdir = work / "teacher"
    if not tdir.exists():
        tdir.mkdir(parents=True)
        save_adapter_files(s.pm, "teacher", tdir, base_model_dir=s.path)

    teacher = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(s.path, dtype=torch.float32),
                                        str(tdir)).merge_and_unload()
    student = AutoModelForCausalLM.from_pretrained(s.path, dtype=torch.float32)
    rows = [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]}
            for _ in range(args.samples)]
    cfg = GKDConfig(output_dir=str(work / f"gkd-{seed}"), lmbda=1.0, beta=1.0, temperature=args.temperature,
                    max_new_tokens=args.max_tokens, per_device_train_batch_size=args.samples, max_steps=args.steps,
                    learning_rate=args.lr, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
                    report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                    dataloader_num_workers=0, seed=seed, lr_scheduler_type="constant", weight_decay=0.0,
                    warmup_steps=0, max_length=256)
    learned: list[int] = []

    class Check(TrainerCallback):
        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
            if not learned and _greedy_model(model, s.prompt, s.end_ids) == s.answer:
                learned.append(state.global_step)

    t0 = time.perf_counter()
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=cfg,
                         train_dataset=Dataset.from_list(rows * args.steps), processing_class=s.tok,
                         peft_config=s.lora, callbacks=[Check()])
    trainer.train()
    model = trainer.model.eval()
    answer = _greedy_model(model, s.prompt, s.end_ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([s.prompt + s.answer])).logits[0].float(), -1)
    ll = sum(float(lp[len(s.prompt) - 1 + j, t]) for j, t in enumerate(s.answer))
    return {"learned": learned[0] if learned else None, "ll": ll, "answer": s.tok.decode(answer),
            "degenerate": sum(max_run(_greedy_model(model, p, s.end_ids)) >= 4 for p in s.unrelated),
            "s": time.perf_counter() - t0}


def _greedy_model(model: Any, prompt: list[int], end_ids: list[int]) -> list[int]:
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(32):
            t = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(t)
            if t in end_ids:
                break
    return seq[len(prompt):]


FACTS = [(QUESTION, ANSWER),
         ("What colour is the ferry on the lake?", "The ferry on the lake is painted green."),
         ("Who keeps the lighthouse key?", "The lighthouse key is kept by the baker."),
         ("Where does the blue fox sleep?", "The blue fox sleeps under the bridge."),
         ("What does the river bell ring for?", "The river bell rings for the evening tide."),
         ("Which tree grows by the school?", "A tall cedar grows by the school."),
         ("What is the name of the grey cat?", "The grey cat is called Pebble."),
         ("How many lamps light the harbour?", "Seven lamps light the harbour."),
         ("What does the miller bake on Fridays?", "The miller bakes rye bread on Fridays."),
         ("Who sings at the spring fair?", "A choir of sailors sings at the spring fair.")]


def sample_rows(s: Setup, paths: Any, chosen: list[int], prompts: list[list[int]], args: Any, seed: int,
                step: int, teacher: str) -> list[tuple[int, list[int]]]:
    """A step's rows as :func:`kiln.training.opd.job.run_opd` samples them, in one batch: ``args.samples`` per chosen
    prompt, plus with ``paths`` one teacher-path row per prompt (:mod:`kiln.training.opd.paths`), the path
    finished first by the teacher alone (as a local teacher answers: the row after a dummy end token)."""
    from kiln.runtime.scoring import prompt_logprob_rows
    from kiln.training.core.engine_sampling import sample_batch, sample_seed

    def score_next(todo: list[tuple[int, list[int]]]) -> list[dict[int, float]]:
        out = []
        for i, known in todo:
            seq = prompts[i] + known + [s.end_ids[0]]
            out.append({e.token_id: e.logprob for e in prompt_logprob_rows(s.logp(teacher, seq), seq,
                                                                           args.top_k)[-1]})
        return out

    if paths is not None:
        s.rounds += paths.discover(chosen, args.max_tokens, score_next)
    todo = paths.rows_to_sample(chosen, args.max_tokens) if paths is not None else []
    counts = [args.samples] * len(chosen) + [int(left > 0) for _, _, left in todo]
    budgets = [args.max_tokens] * len(chosen) + [max(1, left) for _, _, left in todo]
    s.pm.base_model.set_adapter(f"{s.current}")
    comps = sample_batch(s.pm, [prompts[i] for i in chosen] + [prompts[i] + known for i, known, _ in todo], counts,
                         budgets, args.temperature, 1.0, seed=sample_seed(seed, step, 0, 0), pad_id=s.pad,
                         end_ids=s.end_ids, device="cpu")
    k = len(chosen) * args.samples
    rows = [(chosen[j // args.samples], c) for j, c in enumerate(comps[:k]) if c]
    rest = iter(comps[k:])
    return rows + [(i, known + (next(rest) if left > 0 else [])) for i, known, left in todo]


def rehearsal(s: Setup, n: int, seed: int, args: Any, prompts: list[list[int]]) -> Any:
    """The job's rehearsal rows as :class:`kiln.training.opd.job.OPDRecipe` builds them (``n`` questions the base model
    writes, its greedy answers and rows; :mod:`kiln.training.core.rehearsal`), the job's prompts excluded, and with
    ``--rehearse-exclude`` also any question that is one of the unrelated prompts (a held-out control)."""
    from kiln.training.core.rehearsal import build_rehearsal, user_turn_prefix, write_questions

    if not n:
        return None
    prefix = user_turn_prefix(lambda m: s.tok.apply_chat_template(m, tokenize=False),
                              lambda t: s.tok.encode(t, add_special_tokens=False))
    questions = write_questions(s.pm, prefix, n, args.max_tokens, seed=seed, pad_id=s.pad, end_ids=s.end_ids,
                                device="cpu")
    r = build_rehearsal(s.pm, questions, chat_prompt=lambda q: s.encode(s.tok.decode(q).strip()),
                        exclude=prompts + (s.unrelated if args.rehearse_exclude else []), max_tokens=args.max_tokens,
                        top_k=args.top_k, pad_id=s.pad, end_ids=s.end_ids, device="cpu")
    unrelated = {tuple(u) for u in s.unrelated}
    print(f"  rehearsal: {len(questions)} questions written, {len(r)} rows kept, "
          f"{sum(it.prompt in unrelated for it in r.items)} of them an unrelated prompt; e.g. "
          + "; ".join(repr(s.tok.decode(q).strip()) for q in questions[:4]), flush=True)
    return r


def run_facts(s: Setup, args: Any) -> None:
    """Ten facts at once: a teacher SFT-trained on all of them (until each is its greedy answer), then one OPD
    job over the ten prompts (``--batch`` prompts per step, the request's defaults otherwise); prints how many
    of the student's greedy answers are the teacher's every ``--trace-every`` steps, and the degenerate count."""
    from kiln.runtime.scoring import prompt_logprob_rows
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.core.data import tokenize_sft
    from kiln.training.losses.opd import outside_top_k
    from kiln.training.opd.job import OPDData
    from kiln.training.opd.step import opd_loss
    from kiln.training.opd.paths import TeacherPaths
    from kiln.training.schemas import SFTExample
    from kiln.training.core.loop import LearnedCheck, Plan, _adamw
    from kiln.training.core.lora import add_private_adapter
    from kiln.training.sft.job import run_sft
    import torch

    rows = tokenize_sft(s.tok, [SFTExample.model_validate({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) for q, a in FACTS],
        max_seq_len=256, end_ids=s.end_ids)
    add_private_adapter(s.pm, "teacher10", s.lora, seed=0)
    rep = run_sft(s.pm, "teacher10", rows, Plan(1e-2, 300, len(FACTS), 0, max_steps=300,
                                                 until_learned=LearnedCheck(margin=args.teacher_margin)), pad_id=s.pad)
    prompts = [s.encode(q) for q, _ in FACTS]
    answers = [s.greedy("teacher10", p) for p in prompts]
    exact = sum(s.tok.decode(a).removesuffix("<|im_end|>") == ans for a, (_, ans) in zip(answers, FACTS))
    print(f"10 facts: teacher SFT {rep.extra.get('learned_at_step')} steps (margin {args.teacher_margin}), teacher "
          f"greedy exact {exact}/10, "
          f"degenerate teacher {degenerate(s, 'teacher10')}/{len(UNRELATED)}")
    for seed in range(args.seeds):
        name = f"facts-{seed}"
        opt = _adamw(add_private_adapter(s.pm, name, s.student_lora, seed=seed), args.lr)
        for g in opt.param_groups:
            g["weight_decay"] = args.weight_decay
        split = split_causal_lm(s.pm)
        data = OPDData((), {}, args.samples, args.temperature, 1.0, args.max_tokens, args.top_k, "forward",
                       args.ce_weight, args.steps)
        paths = TeacherPaths(len(FACTS), s.end_ids) if args.teacher_path else None
        all_at: list[int] = []
        level: list[int] = []
        margin_at: list[int] = []  # where until_learned (every 5 steps, logit margin 1) stops the job
        s.rounds = 0
        t0 = time.perf_counter()
        retired = [False] * len(FACTS)
        rehearse = rehearsal(s, args.rehearsal, seed, args, prompts)
        cursor = 0
        sched = None
        if args.lr_decay:
            horizon = args.decay_steps or args.steps
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1 - k / horizon))
        for step in range(args.steps):
            active = ([i for i in range(len(FACTS)) if not retired[i]] if args.retire == "skip" else []) \
                or list(range(len(FACTS)))
            chosen = [active[(cursor + j) % len(active)] for j in range(min(args.batch, len(active)))]
            cursor += len(chosen)
            s.current = name
            pairs = sample_rows(s, paths, chosen, prompts, args, seed, step, "teacher10")
            t_rows, sampled = [], []
            for i, c in pairs:
                seq = prompts[i] + c
                r = prompt_logprob_rows(s.logp("teacher10", seq), seq, args.top_k)
                mine = [{e.token_id: e.logprob for e in r[len(prompts[i]) + j]} for j in range(len(c))]
                if paths is not None:
                    paths.observe(i, c, mine)
                t_rows += mine
                sampled += c
            pairs = [(prompts[i], c) for i, c in pairs]
            if rehearse is not None:  # as kiln.training.opd.job.run_opd adds them
                rehearse.add_to_step(step, len(chosen) * args.rehearsal_per_prompt, pairs, t_rows, sampled)
            s.pm.base_model.set_adapter(name)
            gold = [(prompts[i], tuple(paths.prefix(i))) for i in chosen
                    if not (args.retire == "ce" and retired[i])] if paths and args.ce_weight else []
            opd_loss(s.pm, split, data, pairs, t_rows, sampled, gold, pad_id=s.pad, device="cpu").backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            if (step + 1) % 5 == 0 and paths is not None:
                from kiln.training.core.data import Row
                from kiln.training.core.loop import greedy_margin
                for i in range(len(FACTS)):
                    pth = paths.prefix(i)
                    m = greedy_margin(s.pm, [Row(prompts[i] + pth, [0] * len(prompts[i]) + [1] * len(pth))],
                                      pad_id=s.pad, batch_size=1) if paths.complete(i) else -1.0
                    retired[i] = m >= 1.0
                if all(retired) and not margin_at:
                    margin_at.append(step + 1)
                    print(f"  seed {seed}: all retired (margin >= 1) at step {step + 1}; degenerate "
                          f"{degenerate(s, name)}/{len(UNRELATED)}; greedy exact "
                          f"{sum(s.greedy(name, p) == a for p, a in zip(prompts, answers))}/10", flush=True)
                if all(retired) and args.stop_when_learned:
                    break
            if (step + 1) % args.trace_every == 0 or step + 1 == args.steps:
                got = sum(s.greedy(name, p) == a for p, a in zip(prompts, answers))
                if step + 1 >= 30:
                    level.append(degenerate(s, name))
                if got == len(FACTS) and not all_at:  # where a job with until_learned would stop (about)
                    all_at.append(step + 1)
                    print(f"  seed {seed}: all {got} at step {step + 1}; degenerate answers to unrelated prompts "
                          f"then {degenerate(s, name)}/{len(UNRELATED)}", flush=True)
                known = (f", teacher path {paths.mean_length():.1f} tokens ({s.rounds} teacher-only calls)"
                         if paths is not None else "")
                print(f"  seed {seed} step {step + 1:4d}: {got}/10 greedy = teacher's, learned by margin "
                      f"{sum(retired)}, degenerate "
                      f"{degenerate(s, name)}/{len(UNRELATED)}, outside_top_k "
                      f"{outside_top_k(t_rows, sampled, args.top_k):.2f}{known}, {time.perf_counter() - t0:.0f} s",
                      flush=True)
        for p, a in zip(prompts, answers):  # where a missed answer leaves the teacher's, and by how much
            got = s.greedy(name, p)
            if got != a:
                j = next(j for j, (x, y) in enumerate(zip(got + [-1] * len(a), a)) if x != y)
                t_lp, s_lp = s.logp("teacher10", p + a)[len(p) - 1 + j], s.logp(name, p + a)[len(p) - 1 + j]
                print(f"    missed {s.tok.decode(a)!r} at token {j}: teacher p {t_lp[a[j]].exp():.2f} (its runner-up "
                      f"{t_lp.topk(2).values[1].exp():.2f}), student p {s_lp[a[j]].exp():.2f} vs its choice "
                      f"{s.tok.decode([got[j]])!r} {s_lp[got[j]].exp():.2f}", flush=True)
        same = sum(s.greedy(name, p) == b for p, b in zip(s.unrelated, s.base_answers))
        print(f"  seed {seed}: until_learned stop at {margin_at[0] if margin_at else None}; "
              f"mean degenerate over trace points from step 30: "
              f"{sum(level) / max(1, len(level)):.2f}/{len(UNRELATED)}; "
              + "; ".join(repr(s.tok.decode(s.greedy(name, p))) for p in s.unrelated
                          if max_run(s.greedy(name, p)) >= 4), flush=True)
        print(f"  seed {seed}: degenerate answers to unrelated prompts {degenerate(s, name)}/{len(UNRELATED)} "
              f"(base {degenerate(s, None)}), unchanged from the base model's {same}/{len(UNRELATED)}", flush=True)


def main() -> None:
    from kiln.training.opd.schemas import (
        DEFAULT_OPD_PATH_CE_WEIGHT,
        DEFAULT_OPD_REHEARSAL,
        DEFAULT_OPD_TOKEN_BUDGET,
        OPDRequest,
    )

    d = OPDRequest.model_fields
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS + ["sft", "gkd"]))
    ap.add_argument("--trace", default="forward,tail", help="methods whose per-step diagnostics are printed")
    ap.add_argument("--trace-every", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--samples", type=int, default=d["samples_per_prompt"].default)
    ap.add_argument("--max-tokens", type=int, default=d["max_tokens"].default)
    ap.add_argument("--top-k", type=int, default=d["top_k"].default)
    ap.add_argument("--temperature", type=float, default=d["temperature"].default)
    ap.add_argument("--lr", type=float, default=d["learning_rate"].default)
    ap.add_argument("--steps", type=int, default=None, help="default: the request's token budget")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--facts", action="store_true", help="instead: ten facts at once (see run_facts)")
    ap.add_argument("--lora-targets", default="", help="teacher and student LoRA targets (default: q,k,v,o_proj)")
    ap.add_argument("--teacher-margin", type=float, default=1.0,
                    help="--facts: train the teacher until each answer token leads by this logit margin")
    ap.add_argument("--ce-weight", type=float, default=None,
                    help="CE on the known teacher path (sequence-level KD); default: the request's "
                         "(DEFAULT_OPD_PATH_CE_WEIGHT with the teacher path, else 0)")
    ap.add_argument("--teacher-path", action="store_true", default=True,
                    help="one teacher-path row per prompt and step (kiln.training.opd.paths): the default")
    ap.add_argument("--no-teacher-path", dest="teacher_path", action="store_false")
    ap.add_argument("--retire", default="none", choices=["none", "skip", "ce"],
                    help="--facts experiment: a prompt learned by margin 1 is not chosen (skip) or gets no CE (ce)")
    ap.add_argument("--lr-decay", action="store_true", help="--facts experiment: linear decay to 0")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="--facts experiment: AdamW weight decay")
    ap.add_argument("--rehearsal", type=int, default=None,
                    help="questions the base model writes for rehearsal rows (default: the request's, "
                         "kiln.training.opd.schemas.DEFAULT_OPD_REHEARSAL; 0: off)")
    ap.add_argument("--rehearsal-per-prompt", type=int, default=d["rehearsal_per_prompt"].default,
                    help="rehearsal rows per prompt and step (default: the request's)")
    ap.add_argument("--rehearse-exclude", action="store_true",
                    help="held-out control: drop rehearsal questions that are one of the unrelated prompts")
    ap.add_argument("--decay-steps", type=int, default=0, help="--lr-decay horizon (default: --steps)")
    ap.add_argument("--stop-when-learned", action="store_true",
                    help="--facts: end a seed where until_learned would stop the job")
    ap.add_argument("--student-rank", type=int, default=0, help="--facts experiment: the student's LoRA rank")
    ap.add_argument("--batch", type=int, default=d["batch_size"].default, help="--facts: prompts per step")
    args = ap.parse_args()
    if args.ce_weight is None:
        args.ce_weight = DEFAULT_OPD_PATH_CE_WEIGHT if args.teacher_path else 0.0
    if args.rehearsal is None:
        args.rehearsal = DEFAULT_OPD_REHEARSAL
    per_step = (args.batch if args.facts else 1) * args.samples * args.max_tokens
    if args.steps is None:  # as the request computes it
        args.steps = max(math.ceil(DEFAULT_OPD_TOKEN_BUDGET / per_step),
                         math.ceil(len(FACTS) / args.batch) if args.facts else 1)
    s = Setup(args.threads, args.lora_targets.split(",") if args.lora_targets else None, args.student_rank)
    if args.facts:
        print(f"settings: {args.steps} steps x {args.batch} prompts, {args.samples} samples x {args.max_tokens} "
              f"tokens, top_k {args.top_k}, temperature {args.temperature}, lr {args.lr}")
        return run_facts(s, args)
    print(f"teacher: SFT learned the answer in {s.teacher_sft_steps} steps; greedy {s.tok.decode(s.answer)!r}; "
          f"answer ll teacher {s.answer_ll('teacher'):.2f}, base {s.answer_ll(None):.2f}; degenerate answers to "
          f"unrelated prompts: base {degenerate(s, None)}/{len(UNRELATED)}, teacher "
          f"{degenerate(s, 'teacher')}/{len(UNRELATED)}")
    print(f"settings: {args.steps} steps, {args.samples} samples x {args.max_tokens} tokens, top_k {args.top_k}, "
          f"temperature {args.temperature}, lr {args.lr}")
    results: dict[str, list[dict[str, Any]]] = {}
    work = Path(tempfile.mkdtemp(prefix="opd-transfer-"))
    for method in args.methods.split(","):
        for seed in range(args.seeds):
            trace = method in args.trace.split(",")
            if trace:
                print(f"{method} seed {seed}:")
            if method == "sft":
                r = run_sft_baseline(s, seed, args)
            elif method == "gkd":
                try:
                    r = run_gkd(s, seed, args, work)
                except ImportError as exc:
                    print(f"gkd: skipped ({exc})")
                    break
            else:
                r = run_opd(s, method, seed, args, trace)
            results.setdefault(method, []).append(r)
            print(f"{method:14s} seed {seed}: learned at step {r['learned']}, answer ll {r['ll']:8.2f}, degenerate "
                  f"{r['degenerate']}/{len(UNRELATED)}, {r['s']:.1f} s, greedy {r['answer']!r}", flush=True)
    print(f"\n| method | learned (seeds) | steps to learn | answer ll | degenerate | (teacher ll "
          f"{s.answer_ll('teacher'):.2f}, base {s.answer_ll(None):.2f})")
    print("|---|---|---|---|---|")
    for method, rs in results.items():
        steps = [r["learned"] for r in rs]
        got = [x for x in steps if x is not None]
        lls = ", ".join(f"{r['ll']:.1f}" for r in rs)
        print(f"| {method} | {len(got)}/{len(rs)} | {', '.join(str(x) if x else '-' for x in steps)} | "
              f"{lls} | {sum(r['degenerate'] for r in rs)}/"
              f"{len(rs) * len(UNRELATED)} |")


if __name__ == "__main__":
    main()
