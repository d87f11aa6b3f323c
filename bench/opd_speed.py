"""OPD step time, side by side in one run: Kiln OPD vs a Kiln SFT step at equal tokens, and vs TRL's
``GKDTrainer`` (``lmbda=1``: always on-policy, ``beta=1``: reverse KL) on the same model pair and batch.

The student is the model with a fresh LoRA adapter; the teacher is the same base model with another
(random, seeded) LoRA adapter, served by the engine (Kiln: a ``local`` teacher, scoring on the engine;
TRL: the adapter merged into a second model copy, as GKDTrainer wants a model). Each method runs
``--warmup`` steps, then ``--steps`` timed steps; the figures are medians per step, wall clock and the
process's CPU time (steadier on a shared machine). ``--rounds N`` runs the OPD and SFT phases N times each,
alternating which goes first, and prints each round's ratios and their median (load drifts between phases).

* OPD step = student sampling (engine, private adapter) + teacher scoring (engine) + update.
* SFT step = one update on ``batch x samples`` sequences of the same prompts plus completions as long as
  OPD's mean sampled completion (loss on the completion), i.e. the same tokens.
* GKD step = ``GKDTrainer.training_step`` (its ``generate`` + teacher forward + student update),
  ``per_device_train_batch_size = batch x samples``, ``max_new_tokens`` = OPD's ``max_tokens``.

    .venv/bin/python bench/opd_speed.py                   # 31M Qwen3 shape (bench/serving.py's qwen3-31m)
    .venv/bin/python bench/opd_speed.py --shape builtin   # the built-in model
    .venv/bin/python bench/opd_speed.py --shape 4.5m      # hidden 256, 4 layers, 4k vocab (random weights)
    .venv/bin/python bench/opd_speed.py --no-trl --rounds 3   # Kiln only, three alternating OPD/SFT rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def load(shape: str, work: Path) -> Any:
    from kiln.runtime.loader import load_model

    if shape == "builtin":
        from kiln.runtime.builtin import bench_model_path as built_model_path

        return load_model(str(built_model_path()), device="cpu", dtype="float32")
    sys.path.insert(0, str(ROOT / "bench"))
    if shape == "31m":  # bench/serving.py's qwen3-31m: random weights, the built-in tokenizer and chat template
        from serving import build_shape_model

        return load_model(str(build_shape_model("qwen3-31m", work)), device="cpu", dtype="float32")
    from training import build_bench_model

    out = work / f"model-{shape}"
    build_bench_model(out, shape)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return load_model(str(out), device="cpu", dtype="float32")


def teacher_adapter(loaded: Any, out: Path, rank: int) -> Path:
    """A random, seeded LoRA adapter (non-zero B) saved as standard PEFT files: the teacher's weights."""
    import torch
    from peft import get_peft_model

    from kiln.training.core.lora import lora_config, save_adapter_files

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32)
    torch.manual_seed(7)
    pm = get_peft_model(base, lora_config(rank, 2 * rank, LORA_TARGETS), adapter_name="teacher")
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    save_adapter_files(pm, "teacher", out, base_model_dir=str(loaded.path))
    return out


def prompts_for(loaded: Any, batch: int) -> list[list[dict[str, str]]]:
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    return [[{"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(6 + i % 3))}]
            for i in range(batch)]


def kiln_opd(loaded: Any, engine: Any, adapter_dir: Path, chats: list, args: Any) -> dict[str, Any]:
    from kiln.teachers.kiln_identity import KilnTeacherIdentity
    from kiln.teachers.probe import LocalTeacher
    from kiln.training.opd.job import OPDData, OPDItem, run_opd
    from kiln.training.opd.schemas import DEFAULT_OPD_PATH_CE_WEIGHT, OPDRequest
    from kiln.training.core.templates import end_of_turn_ids
    from kiln.training.core.loop import Hooks, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config

    engine.activate_adapter("teacher", adapter_dir, "r1")
    ident = KilnTeacherIdentity(loaded, max_model_len=engine.config.max_model_len, max_top_k=args.top_k)
    fp = ident.identity("teacher", ("teacher", "r1", adapter_dir)).fingerprint()
    teacher = LocalTeacher(engine, "teacher", adapter="teacher", fingerprint=lambda: fp)
    items = tuple(OPDItem(tuple(engine.encode_chat(c)), tuple(engine.encode_chat(c)), None) for c in chats)
    total = args.warmup + args.steps
    d = OPDRequest.model_fields  # the request defaults: loss, temperature, teacher_path with CE on it
    data = OPDData(items, {"identity": ident.identity("teacher", ("teacher", "r1", adapter_dir)).to_json(),
                           "fingerprint": fp}, args.samples, d["temperature"].default, 1.0, args.max_tokens,
                   args.top_k, d["loss"].default, DEFAULT_OPD_PATH_CE_WEIGHT, total,
                   teacher_path=d["teacher_path"].default, rehearsal=args.rehearsal,
                   rehearsal_per_prompt=args.rehearsal_per_prompt)
    pm = engine.peft_model()
    with engine.ownership.exclusive():
        add_private_adapter(pm, "opd-student", lora_config(args.rank, 2 * args.rank, LORA_TARGETS), seed=0)
    end_ids = sorted(end_of_turn_ids(loaded.tokenizer, getattr(loaded.model, "generation_config", None)))
    rehearsal, setup_s = None, 0.0
    if args.rehearsal:  # built once per job, as OPDRecipe builds it (not part of a step)
        from kiln.training.core.rehearsal import job_rehearsal

        t0 = time.perf_counter()
        with engine.ownership.exclusive():
            rehearsal = job_rehearsal(pm, lambda m: loaded.tokenizer.apply_chat_template(m, tokenize=False), engine,
                                      data, seed=0, pad_id=loaded.tokenizer.pad_token_id or 0, end_ids=end_ids)
        setup_s = time.perf_counter() - t0
    walls: list[float] = []
    cpus: list[float] = []
    per_step: list[dict[str, float]] = []
    last: dict[str, float] = {"student_s": 0.0, "teacher_s": 0.0, "step_s": 0.0, "sampled_tokens": 0,
                              "rehearsal_tokens": 0}
    t_prev = [time.perf_counter(), time.process_time()]

    latest: dict[str, Any] = {}  # the last progress (teacher_path_tokens: the known paths' mean length)

    def progress(p: dict[str, Any]) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        walls.append(now - t_prev[0])
        cpus.append(cpu - t_prev[1])
        t_prev[:] = [now, cpu]
        latest.update(p)
        per_step.append({k: p.get(k, 0.0) - last[k] for k in last})
        last.update({k: p.get(k, 0.0) for k in last})

    import kiln.training.core.loop as trainer_mod

    trainer_mod.PROGRESS_EVERY_S = 0.0  # a progress callback after every step: per-step times
    plan = Plan(args.lr, 1, len(chats), 0, 0, max_steps=total)
    import inspect

    # run_opd before it sampled on the engine (no `engine` argument) can be measured with the same script
    extra = {"engine": engine} if "engine" in inspect.signature(run_opd).parameters else {}
    report = run_opd(pm, "opd-student", data, plan, teacher=teacher, pinned=fp, model_id="teacher",
                     vocab_size=ident.vocab_size, hooks=Hooks(exclusive=engine.ownership.exclusive,
                                                              on_progress=progress),
                     resume=None, pad_id=loaded.tokenizer.pad_token_id or 0, end_ids=end_ids, **extra,
                     **({"rehearsal": rehearsal} if rehearsal is not None else {}))
    engine.delete_private_adapter("opd-student")
    timed = per_step[args.warmup:]
    return {"step_s": statistics.median(walls[args.warmup:]), "cpu_s": statistics.median(cpus[args.warmup:]),
            "student_s": statistics.median(s["student_s"] for s in timed),
            "teacher_s": statistics.median(s["teacher_s"] for s in timed),
            "update_s": statistics.median(s["step_s"] for s in timed),
            "tokens": statistics.mean(s["sampled_tokens"] for s in timed), "loss": report.final_loss,
            "rehearsal_tokens": statistics.mean(s["rehearsal_tokens"] for s in timed),
            # tokens the loss is on: samples, the teacher-path rows (one per prompt) and the rehearsal rows
            "trained_tokens": statistics.mean(s["sampled_tokens"] + s["rehearsal_tokens"] for s in timed)
                              + args.batch * float(latest.get("teacher_path_tokens") or 0.0),
            "rehearsal_rows": len(rehearsal) if rehearsal is not None else 0, "rehearsal_setup_s": setup_s}


def kiln_sft(loaded: Any, engine: Any, chats: list, completion_len: int, args: Any) -> dict[str, Any]:
    import torch

    from kiln.training.core.data import Row
    from kiln.training.core.loop import Hooks, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.sft.job import run_sft

    gen = torch.Generator().manual_seed(3)
    vocab = loaded.model.config.vocab_size
    rows = []
    for _ in range(args.samples):
        for c in chats:
            p = engine.encode_chat(c)
            comp = torch.randint(3, vocab, (completion_len,), generator=gen).tolist()
            rows.append(Row(p + comp, [0] * len(p) + [1] * completion_len))
    total = args.warmup + args.steps
    pm = engine.peft_model()
    with engine.ownership.exclusive():
        add_private_adapter(pm, "sft-student", lora_config(args.rank, 2 * args.rank, LORA_TARGETS), seed=0)
    walls: list[float] = []
    cpus: list[float] = []
    t_prev = [time.perf_counter(), time.process_time()]

    def progress(p: dict[str, Any]) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        walls.append(now - t_prev[0])
        cpus.append(cpu - t_prev[1])
        t_prev[:] = [now, cpu]

    plan = Plan(args.lr, total, len(rows), 0, 0, max_steps=total)
    run_sft(pm, "sft-student", rows, plan, pad_id=loaded.tokenizer.pad_token_id or 0,
            hooks=Hooks(exclusive=engine.ownership.exclusive, on_progress=progress))
    engine.delete_private_adapter("sft-student")
    return {"step_s": statistics.median(walls[args.warmup:]), "cpu_s": statistics.median(cpus[args.warmup:]),
            "tokens": completion_len * len(rows)}


def trl_gkd(loaded: Any, adapter_dir: Path, chats: list, work: Path, args: Any) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from kiln.training.core.lora import lora_config

    path = str(loaded.path)
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    teacher = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                        str(adapter_dir)).merge_and_unload()
    rows = [{"messages": c + [{"role": "assistant", "content": "x"}]} for c in chats for _ in range(args.samples)]
    total = args.warmup + args.steps
    cfg = GKDConfig(output_dir=str(work / "gkd"), lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=args.max_tokens,
                    per_device_train_batch_size=len(rows), max_steps=total, learning_rate=args.lr,
                    bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to=[],
                    save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                    seed=0, lr_scheduler_type="constant", weight_decay=0.0, max_length=512)
    walls: list[float] = []

    class Timer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            Timer.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            walls.append(time.perf_counter() - Timer.t0)

    tok = loaded.tokenizer
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=cfg, train_dataset=Dataset.from_list(rows * total),
                         processing_class=tok, peft_config=lora_config(args.rank, 2 * args.rank, LORA_TARGETS),
                         callbacks=[Timer()])
    trainer.train()
    return {"step_s": statistics.median(walls[args.warmup:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="31m", choices=["builtin", "4.5m", "31m"])
    ap.add_argument("--batch", type=int, default=4, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1,
                    help="OPD and SFT phases this many times each, alternating which runs first (a shared "
                         "machine's load drifts between phases); ratios per round and their median")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--rehearsal", type=int, default=None,
                    help="rehearsal questions (default: the request's, DEFAULT_OPD_REHEARSAL; 0: none)")
    ap.add_argument("--rehearsal-per-prompt", type=int, default=None, help="default: the request's")
    args = ap.parse_args()
    from kiln.training.opd.schemas import DEFAULT_OPD_REHEARSAL, DEFAULT_OPD_REHEARSAL_PER_PROMPT

    args.rehearsal = DEFAULT_OPD_REHEARSAL if args.rehearsal is None else args.rehearsal
    args.rehearsal_per_prompt = args.rehearsal_per_prompt or DEFAULT_OPD_REHEARSAL_PER_PROMPT

    import os

    import torch

    from kiln.runtime.engine import Engine, EngineConfig

    work = Path(tempfile.mkdtemp(prefix="kiln-opd-speed-"))
    loaded = load(args.shape, work)
    engine = Engine(loaded, EngineConfig(max_model_len=512)).start()
    adapter_dir = teacher_adapter(loaded, work / "teacher", args.rank)
    chats = prompts_for(loaded, args.batch)
    print(f"model {args.shape} ({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.2f}M params, vocab "
          f"{loaded.model.config.vocab_size}), batch {args.batch} prompts x {args.samples} samples, max_tokens "
          f"{args.max_tokens}, top_k {args.top_k}, LoRA r={args.rank}; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    walls, cpus, walls_trained = [], [], []
    try:
        comp_len = 0
        for r in range(args.rounds):
            for phase in (("opd", "sft") if r % 2 == 0 else ("sft", "opd")):
                if phase == "opd" or not comp_len:  # SFT needs OPD's mean completion length: OPD runs first once
                    opd = kiln_opd(loaded, engine, adapter_dir, chats, args)
                    comp_len = max(1, round(opd["tokens"] / (args.batch * args.samples)))
                if phase == "sft":
                    sft = kiln_sft(loaded, engine, chats, comp_len, args)
                    # the same number of rows, as many tokens as OPD's loss is on (samples, paths, rehearsal)
                    sft_trained = kiln_sft(loaded, engine, chats, max(1, round(
                        opd["trained_tokens"] / (args.batch * args.samples))), args)
            walls.append(opd["step_s"] / sft["step_s"])
            cpus.append(opd["cpu_s"] / sft["cpu_s"])
            walls_trained.append(opd["step_s"] / sft_trained["step_s"])
            print(f"round {r}: kiln OPD step {opd['step_s'] * 1e3:8.1f} ms  (student sampling "
                  f"{opd['student_s'] * 1e3:.1f}, teacher {opd['teacher_s'] * 1e3:.1f}, update "
                  f"{opd['update_s'] * 1e3:.1f}; {opd['tokens']:.0f} sampled tokens, {opd['rehearsal_tokens']:.0f} "
                  f"rehearsal tokens ({opd['rehearsal_rows']} rows, built once in {opd['rehearsal_setup_s']:.1f} s); "
                  f"CPU {opd['cpu_s']:.2f} s)", flush=True)
            print(f"round {r}: kiln SFT step {sft['step_s'] * 1e3:8.1f} ms  ({sft['tokens']} completion tokens, "
                  f"same prompts; CPU {sft['cpu_s']:.2f} s)", flush=True)
            print(f"round {r}: OPD / SFT at equal tokens: {walls[-1]:.2f}x whole step (target <= 2x), CPU time "
                  f"{cpus[-1]:.2f}x; update only {opd['update_s'] / sft['step_s']:.2f}x; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            print(f"round {r}: OPD / SFT at equal trained tokens ({opd['trained_tokens']:.0f}: samples, teacher paths, "
                  f"rehearsal; SFT step {sft_trained['step_s'] * 1e3:.1f} ms): {walls_trained[-1]:.2f}x whole step",
                  flush=True)
    finally:
        engine.stop()
    if args.rounds > 1:
        print(f"OPD / SFT whole step, median of {args.rounds} rounds: {statistics.median(walls):.2f}x wall "
              f"({', '.join(f'{w:.2f}' for w in walls)}), {statistics.median(cpus):.2f}x CPU time "
              f"({', '.join(f'{c:.2f}' for c in cpus)}); at equal trained tokens {statistics.median(walls_trained):.2f}x "
              f"wall ({', '.join(f'{w:.2f}' for w in walls_trained)})")
    if not args.no_trl:
        gkd = trl_gkd(loaded, adapter_dir, chats, work, args)
        print(f"TRL GKD step   {gkd['step_s'] * 1e3:8.1f} ms  (lmbda=1, beta=1)")
        print(f"GKDTrainer / Kiln OPD: {gkd['step_s'] / opd['step_s']:.2f}x (target >= 3x)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
