"""GRPO with rollouts on a verifiable toy task, Kiln vs TRL ``GRPOTrainer`` side by side.

    .venv/bin/python bench/grpo_rollouts.py [--iterations 8] [--group-size 8] [--seed 3] [--no-trl]

The task: make the built-in model's short answers contain the word "spider" (reward = the
`contains` eval scorer against the reference "spider": verifiable, 1 or 0). The base model hits it
about one sample in six at the start (4-token samples at temperature 1), so groups have reward
variance from the first iteration. Trained on four questions, checked on four held-out ones
(8 samples each from the trained adapter, same sampling settings; "accuracy" is the share that
contains the word). Kiln runs its training service in process on the real engine and adapter store
(as tests/training do, with the torch thread count `kiln serve` picks: cores - 1), in a temporary
KILN_HOME; TRL runs ``GRPOTrainer`` on the same model, prompts, group size, optimizer steps, LoRA
shape, constant learning rate and reward (when ``trl`` is installed, with torch's default threads).
Prints both and the ratios.

Kiln runs twice in the same process: sampling on the engine's continuous batching (what jobs do) and
with one batched seeded ``PeftModel.generate`` (the sampler rollouts used before, still the fallback
where the engine cannot run the private adapter), each reporting wall time per iteration and the share
of it spent sampling.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN = ["What color is the sky?", "What is two plus two?", "How many legs does an ant have?", "Name a fruit."]
HELD_OUT = ["What is the capital of France?", "Name an animal.", "What day comes after Monday?",
            "What is water made of?"]
WORD = "spider"


def held_out_reward(engine, adapter, *, samples: int, max_tokens: int, seed: int) -> float:
    from kiln.runtime.sampling import SamplingParams

    hits = total = 0
    for q, question in enumerate(HELD_OUT):
        ids = engine.encode_chat([{"role": "user", "content": question}])
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 1000 + q * 100 + k)
                  for k in range(samples)]
        for c in engine.generate(ids, params, adapter=adapter, timeout=120):
            hits += WORD in c.text.casefold()
            total += 1
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--learning-rate", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL GRPOTrainer comparison")
    ap.add_argument("--rounds", type=int, default=2, help="Kiln jobs per sampler, alternating (best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for Kiln (0: what `kiln serve` picks)")
    ap.add_argument("--serve", action="store_true",
                    help="one client generating 8 tokens on the base model back to back while each job runs: "
                         "its request latency shows how long training holds serving up")
    args = ap.parse_args()

    import torch

    from kiln.config import load_settings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.threads import default_threads
    from kiln.adapters.store import AdapterStore
    from kiln.serving.state import build_training
    from kiln.runtime.builtin import bench_model_path as built_model_path

    home = Path(tempfile.mkdtemp(prefix="kiln-grpo-bench-"))
    settings = load_settings(cli={"home": str(home)}, environ={}).settings
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or settings.model.threads or default_threads())  # as `kiln serve` does
    loaded = load_model(built_model_path(), device="auto")
    engine = Engine(loaded, EngineConfig()).start()
    trainer = build_training(settings, engine, AdapterStore(settings.adapters_path), loaded)  # as kiln serve
    trainer.start()
    state = SimpleNamespace(engine=engine, settings=settings, loaded=loaded, trainer=trainer)
    try:
        before = held_out_reward(engine, None, samples=8, max_tokens=args.max_tokens, seed=args.seed)
        print(f"device={loaded.device} torch_threads={torch.get_num_threads()} iterations={args.iterations} "
              f"group_size={args.group_size} prompts={len(TRAIN)} max_tokens={args.max_tokens}")
        runs: dict[str, list[dict]] = {"engine": [], "generate": []}
        for r in range(args.rounds):  # alternating, so neither sampler always runs first
            for sampler in (("engine", "generate") if r % 2 == 0 else ("generate", "engine")):
                runs[sampler].append(kiln_grpo(state, engine, args, sampler, r))
    finally:
        state.trainer.close()
        engine.stop()
        torch.set_num_threads(torch_threads)
    _load = " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())
    eng, gen = (min(runs[k], key=lambda x: x["wall_per_it"]) for k in ("engine", "generate"))
    print(f"\n{'Kiln (best of ' + str(args.rounds) + '), sampling on':34}{'engine':>10}{'generate':>10}{'ratio':>8}"
          f"   (load average {_load})")
    for label, key in (("wall time per iteration (s)", "wall_per_it"), ("sampling per iteration (s)", "sample_per_it")):
        print(f"{label:34}{eng[key]:>10.3f}{gen[key]:>10.3f}{eng[key] / gen[key]:>8.2f}   all rounds: engine "
              + " ".join(f"{x[key]:.3f}" for x in runs["engine"]) + ", generate "
              + " ".join(f"{x[key]:.3f}" for x in runs["generate"]))
    print(f"{'sampling share of wall time':34}{eng['sample_share']:>10.2f}{gen['sample_share']:>10.2f}")
    print(f"{'held-out accuracy':34}{eng['accuracy']:>10.3f}{gen['accuracy']:>10.3f}   (base model {before:.3f})")
    if args.no_trl:
        return
    wall, after, report = eng["wall"], eng["accuracy"], eng["report"]
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL GRPOTrainer comparison: skipped, `trl` is not installed (pip install trl)")
        return
    trl_wall, trl_acc, trl_steps = trl_grpo(built_model_path(), args)
    _load = " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())
    print(f"\n{'':24}{'Kiln':>10}{'TRL':>10}{'Kiln/TRL':>10}   (load average {_load})")
    print(f"{'wall time (s)':24}{wall:>10.2f}{trl_wall:>10.2f}{wall / trl_wall:>10.2f}")
    print(f"{'held-out accuracy':24}{after:>10.3f}{trl_acc:>10.3f}{'':>10}   (base model {before:.3f})")
    print(f"{'optimizer steps':24}{report['steps']:>10}{trl_steps:>10}")


def serve_client(engine, stop, latencies: list) -> None:
    """Back-to-back 8-token requests on the base model until ``stop``; appends each latency (s)."""
    from kiln.runtime.sampling import SamplingParams

    ids = engine.encode_chat([{"role": "user", "content": "Name an animal."}])
    while not stop.is_set():
        t = time.perf_counter()
        engine.generate(ids, SamplingParams(max_tokens=8, temperature=1.0), timeout=120)
        latencies.append(time.perf_counter() - t)


def kiln_grpo(state, engine, args: argparse.Namespace, sampler: str, round_: int) -> dict:
    """One Kiln rollout job; ``sampler`` "generate" makes the job sample as engines without private-adapter
    sampling do (one batched ``PeftModel.generate``)."""
    from kiln.training.core import engine_sampling
    from kiln.training.schemas import GRPORequest

    on_engine = engine_sampling.samples_on_engine
    if sampler == "generate":
        engine_sampling.samples_on_engine = lambda _engine: False
    adapter = f"grpo-bench-{sampler}-{round_}"
    try:
        req = GRPORequest.model_validate({
            "adapter": adapter, "auto_load": True, "seed": args.seed, "learning_rate": args.learning_rate,
            "batch_size": 4, "group_size": args.group_size, "iterations": args.iterations,
            "max_tokens": args.max_tokens, "temperature": 1.0,
            "prompts": [{"messages": [{"role": "user", "content": q}], "reference": WORD} for q in TRAIN],
            "reward": {"type": "scorer", "scorer": {"type": "contains"}}})
        stop, latencies = threading.Event(), []
        client = threading.Thread(target=serve_client, args=(engine, stop, latencies), daemon=True)
        if args.serve:
            client.start()
        t0 = time.perf_counter()
        job = state.trainer.submit(req)
        while (job := state.trainer.job(job["id"]))["state"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    finally:
        engine_sampling.samples_on_engine = on_engine
        stop.set()
        if client.is_alive():
            client.join()
    if job["state"] != "succeeded":
        raise SystemExit(f"job {job['state']}: {job['error']}")
    report = job["result"]["report"]
    after = held_out_reward(engine, adapter, samples=8, max_tokens=args.max_tokens, seed=args.seed)
    print(f"\nKiln, sampler {sampler}: {report['behaviour_policy']['sampler']}")
    for i, (r, z) in enumerate(zip(report["reward_per_iteration"], report["zero_variance_fraction_per_iteration"])):
        print(f"iteration {i + 1}: mean reward {r:.3f}  zero-variance groups {z:.2f}")
    print(f"held-out reward (8 samples x {len(HELD_OUT)} prompts): adapter {after:.3f}")
    print(f"wall time submit->published+activated {wall:.2f} s (sampling {report['sample_s']:.2f} s, "
          f"reward {report['reward_s']:.3f} s, optimizer steps {report['steps']}, "
          f"train {report['train_seconds']:.2f} s)")
    if latencies:
        lat = sorted(latencies)
        print(f"serving during the job: {len(lat)} requests, latency p50 {lat[len(lat) // 2] * 1e3:.1f} ms, "
              f"p90 {lat[int(len(lat) * 0.9)] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms")
    its = len(report["reward_per_iteration"])
    return {"wall": wall, "accuracy": after, "report": report, "wall_per_it": wall / its,
            "sample_per_it": report["sample_s"] / its, "sample_share": report["sample_s"] / wall}


def trl_grpo(model_dir: Path, args: argparse.Namespace) -> tuple[float, float, int]:
    """TRL ``GRPOTrainer`` on the same model, prompts, group size, steps, LoRA shape, LR and reward."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def reward(completions, **kw):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [1.0 if WORD in t.casefold() else 0.0 for t in texts]

    prompts = [[{"role": "user", "content": q}] for q in TRAIN] * args.iterations
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="kiln-grpo-bench-trl-"),
                     per_device_train_batch_size=args.group_size * len(TRAIN), num_generations=args.group_size,
                     max_completion_length=args.max_tokens, max_steps=args.iterations,
                     learning_rate=args.learning_rate, lr_scheduler_type="constant", beta=0.0, temperature=1.0, bf16=False,
                     gradient_checkpointing=False, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                     disable_tqdm=True,
                     seed=args.seed)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", "q_proj",
                                                                                        "v_proj"]))
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    model = trainer.model.eval()
    hits = total = 0
    with torch.no_grad():
        for q, question in enumerate(HELD_OUT):
            ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            torch.manual_seed(args.seed * 1000 + q)
            out = model.generate(input_ids=ids.repeat(8, 1), attention_mask=torch.ones_like(ids.repeat(8, 1)),
                                 do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.max_tokens,
                                 pad_token_id=tok.pad_token_id)
            for row in out[:, ids.shape[1]:]:
                hits += WORD in tok.decode(row, skip_special_tokens=True).casefold()
                total += 1
    print(f"TRL {trl.__version__} GRPOTrainer: reward per step "
          + ", ".join(f"{r:.3f}" for r in rewards)
          + f"; held-out reward {hits / total:.3f}; wall time {wall:.2f} s ({trainer.state.global_step} steps)")
    return wall, hits / total, trainer.state.global_step


if __name__ == "__main__":
    main()
