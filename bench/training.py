"""Training benchmarks: Kiln's trainer next to its peers, in one run.

    .venv/bin/python bench/training.py                 # everything (TRL default SFTConfig is slow: ~minutes)
    .venv/bin/python bench/training.py --skip-trl-default --steps 10

1. LoRA SFT throughput and peak memory on a 4.5M-parameter Qwen3 (hidden 256,
   4 layers, vocab 4096), r=8 on q/k/v/o, batch 8 x 128 tokens, the same random
   token data and the same number of timed steps for every peer:
   plain PyTorch + PEFT loop, Kiln's trainer (`kiln.training.trainer.run_sft` on
   the engine's PEFT wrapping, each step under exclusive ownership), TRL
   `SFTTrainer` matched (fp32, no gradient checkpointing, constant LR, no
   clipping) and TRL with its default `SFTConfig`. Each peer runs in its own
   subprocess so its peak RSS is its own.
2. GRPO step time (Kiln, built-in model, 4 groups x 8 completions per step) and
   TRL `GRPOTrainer` on the same model, group size and batch (TRL generates its
   own completions inside the step; its time is reported with that caveat).
3. Seconds from an SFT correction's submit to the first response from the new
   adapter, on a real `kiln serve` with the built-in model.
4. Chat latency p50/p99 on that server idle vs while a training job runs.

Requires `pip install trl==1.16.*` (the `bench` extra) for the TRL peers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, RANK, WARMUP = 128, 8, 8, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LR = 1e-4
VOCAB = 4096
SEED = 1234
CHAT_REQUESTS = 50
CHAT_MAX_TOKENS = 16


# ------------------------------------------------------------------ the model


def build_bench_model(out: Path) -> Path:
    """A 4.5M-parameter Qwen3 with random weights and a word-level tokenizer (offline)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(out)
    torch.manual_seed(SEED)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    return out


def bench_data(steps: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(2, VOCAB, (steps * BATCH, SEQ), generator=gen).tolist()


def _load(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ SFT peers


def peer_plain(model_dir: Path, steps: int) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_load(model_dir), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                        lora_dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    data = torch.tensor(bench_data(WARMUP + steps))
    t0 = c0 = 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP:
            t0, c0 = time.perf_counter(), time.process_time()
        batch = data[i * BATCH:(i + 1) * BATCH]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def peer_kiln(model_dir: Path, steps: int) -> dict[str, Any]:
    from kiln.runtime.adapter_slots import AdapterSlots
    from kiln.runtime.ownership import AcceleratorOwnership
    from kiln.training.data import Row
    from kiln.training.trainer import Hooks, Plan, add_private_adapter, lora_config, run_sft

    ownership = AcceleratorOwnership()
    base = _load(model_dir)
    base.eval()  # as served
    peft_model = AdapterSlots(base, ownership).peft_model()  # the engine's own wrapping
    with ownership.exclusive():
        add_private_adapter(peft_model, "kiln-bench", lora_config(RANK, 2 * RANK, TARGETS), seed=SEED)
    rows = [Row(ids, [1] * SEQ) for ids in bench_data(WARMUP + steps)]
    hooks = Hooks(exclusive=ownership.exclusive)
    run_sft(peft_model, "kiln-bench", rows[:WARMUP * BATCH], Plan(LR, 1, BATCH, SEED), pad_id=0, hooks=hooks)
    t0, c0 = time.perf_counter(), time.process_time()
    run_sft(peft_model, "kiln-bench", rows[WARMUP * BATCH:], Plan(LR, 1, BATCH, SEED), pad_id=0, hooks=hooks)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def peer_trl(model_dir: Path, steps: int, *, matched: bool) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            if state.global_step == WARMUP:
                marks.extend((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            if state.global_step == WARMUP + steps:
                marks.extend((time.perf_counter(), time.process_time()))

    out = tempfile.mkdtemp(prefix="kiln-bench-trl-")
    common = dict(output_dir=out, per_device_train_batch_size=BATCH, max_steps=WARMUP + steps, max_length=SEQ,
                  save_strategy="no", report_to=[], use_cpu=True, seed=SEED, dataloader_num_workers=0,
                  logging_steps=10_000)
    if matched:
        args = SFTConfig(**common, learning_rate=LR, bf16=False, fp16=False, gradient_checkpointing=False,
                         lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0)
    else:
        args = SFTConfig(**common)
    ds = Dataset.from_dict({"input_ids": bench_data(WARMUP + steps)})
    trainer = SFTTrainer(model=_load(model_dir), args=args, train_dataset=ds,
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0),
                         callbacks=[Clock()])
    trainer.train()
    return {"seconds": marks[2] - marks[0], "cpu_seconds": marks[3] - marks[1], "bf16": bool(trainer.args.bf16),
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing)}


PEERS = {
    "plain": lambda d, s: peer_plain(d, s),
    "kiln": lambda d, s: peer_kiln(d, s),
    "trl_matched": lambda d, s: peer_trl(d, s, matched=True),
    "trl_default": lambda d, s: peer_trl(d, s, matched=False),
}


def run_peer(name: str, model_dir: Path, steps: int) -> dict[str, Any]:
    """Run one peer in a fresh interpreter; returns its JSON result."""
    cmd = [sys.executable, __file__, "--peer", name, "--model-dir", str(model_dir), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ GRPO


def bench_grpo(builtin_dir: Path, steps: int, group: int = 8, groups_per_step: int = 4) -> dict[str, Any]:
    from kiln.runtime.adapter_slots import AdapterSlots
    from kiln.runtime.loader import load_model
    from kiln.runtime.ownership import AcceleratorOwnership
    from kiln.training.data import tokenize_grpo_group
    from kiln.training.schemas import GRPOGroup
    from kiln.training.trainer import GRPOSettings, Hooks, Plan, add_private_adapter, grpo_items, lora_config, run_grpo

    lm = load_model(builtin_dir, device="cpu")
    ownership = AcceleratorOwnership()
    peft_model = AdapterSlots(lm.model, ownership).peft_model()
    with ownership.exclusive():
        add_private_adapter(peft_model, "kiln-grpo", lora_config(RANK, 2 * RANK, TARGETS), seed=SEED)
    groups = [GRPOGroup.model_validate({
        "messages": [{"role": "user", "content": f"Count to {g}."}],
        "completions": [{"text": " ".join(str(k) for k in range(1 + (c + g) % 12)), "reward": float(c % 3)}
                        for c in range(group)]}) for g in range(groups_per_step * steps)]
    rows = [tokenize_grpo_group(lm.tokenizer, g, max_seq_len=512) for g in groups]
    items, _ = grpo_items(rows, [[c.reward for c in g.completions] for g in groups], scale_rewards=True)
    rep = run_grpo(peft_model, "kiln-grpo", items, Plan(1e-4, 1, groups_per_step, SEED),
                   GRPOSettings(kl_coef=0.04), pad_id=lm.tokenizer.pad_token_id, hooks=Hooks(exclusive=ownership.exclusive))
    return {"kiln_step_s": rep.train_seconds / rep.steps, "steps": rep.steps,
            "rows_per_step": group * groups_per_step}


def bench_trl_grpo(builtin_dir: Path, steps: int, group: int = 8, groups_per_step: int = 4) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(builtin_dir)
    prompts = [[{"role": "user", "content": f"Count to {g}."}] for g in range(groups_per_step * (steps + 1))]

    def reward(completions, **kw):  # noqa: ANN001
        return [float(len(str(c)) % 3) for c in completions]

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="kiln-bench-grpo-"), per_device_train_batch_size=group * groups_per_step,
                      num_generations=group, max_completion_length=12, max_steps=steps + 1, learning_rate=1e-4,
                      beta=0.04, bf16=False, gradient_checkpointing=False, report_to=[], save_strategy="no",
                      use_cpu=True, logging_steps=10_000, seed=SEED)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(builtin_dir), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))
    t0 = time.perf_counter()
    trainer.train()
    return {"trl_step_s_incl_generation": (time.perf_counter() - t0) / (steps + 1)}


# --------------------------------------------------------- server: latency loop


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _chat_latencies(client: Any, model: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": CHAT_MAX_TOKENS, "temperature": 0,
                                                       "messages": [{"role": "user", "content": f"Question {i}?"}]})
        r.raise_for_status()
        out.append(time.perf_counter() - t)
    return out


def bench_server(home: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "src"))
    from kiln.demo import CORRECTION, QUESTION, kiln_server, run_correction, wait_job

    res: dict[str, Any] = {}
    with kiln_server(home) as server:
        client = server.client
        timings = run_correction(client, question=QUESTION, correction=CORRECTION, adapter="bench-fix",
                                 echo=lambda *a: None)
        res["submit_to_first_adapter_response_s"] = timings["submit -> corrected answer"]
        model = client.get("/v1/models").json()["data"][0]["id"]
        _chat_latencies(client, model, 3)  # warm-up
        idle = _chat_latencies(client, model, CHAT_REQUESTS)
        examples = [{"messages": [{"role": "user", "content": f"Fact {i}?"},
                                  {"role": "assistant", "content": f"Fact {i} is true and well known."}]}
                    for i in range(8)]
        job = client.post("/v1/train/sft", json={"adapter": "bench-load", "examples": examples, "epochs": 1000,
                                                 "batch_size": 8}).json()
        while client.get(f"/v1/train/jobs/{job['id']}").json()["state"] != "running":
            time.sleep(0.05)
        busy = _chat_latencies(client, model, CHAT_REQUESTS)
        during = client.get(f"/v1/train/jobs/{job['id']}").json()
        client.delete(f"/v1/train/queue/{job['id']}")
        wait_job(client, job["id"])
    res.update(
        chat_idle_p50_s=_pct(idle, 0.5), chat_idle_p99_s=_pct(idle, 0.99),
        chat_training_p50_s=_pct(busy, 0.5), chat_training_p99_s=_pct(busy, 0.99),
        training_steps_during_chat=during.get("step"), training_tokens_per_s_during_chat=during.get("tokens_per_s"),
    )
    res["chat_p99_ratio_training_vs_idle"] = res["chat_training_p99_s"] / res["chat_idle_p99_s"]
    return res


# ----------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed SFT steps per peer (after 2 warm-up steps)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per SFT peer (best one is kept)")
    ap.add_argument("--grpo-steps", type=int, default=3)
    ap.add_argument("--skip-trl-default", action="store_true", help="skip TRL's default SFTConfig (slow on CPU)")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-grpo", action="store_true")
    ap.add_argument("--peers", default="plain,kiln,trl_matched,trl_default", help="SFT peers to run (comma list)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.peer:  # child process: one SFT peer
        result = PEERS[args.peer](args.model_dir, args.steps)
        tokens = BATCH * SEQ * args.steps
        result.update(tokens_per_s=tokens / result["seconds"], cpu_ms_per_1k_tokens=1e6 * result["cpu_seconds"] / tokens,
                      peak_rss_mib=_peak_mib())
        print(json.dumps(result))
        return

    sys.path.insert(0, str(ROOT / "src"))
    import torch

    results: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "steps": args.steps,
                               "batch": BATCH, "seq": SEQ, "rank": RANK}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        model_dir = build_bench_model(Path(tmp) / "qwen3-4.5m")
        n_params = sum(p.numel() for p in _load(model_dir).parameters())
        results["sft_model_params"] = n_params
        print(f"SFT: {n_params / 1e6:.2f}M-param Qwen3, LoRA r={RANK} {'/'.join(TARGETS)}, batch {BATCH}x{SEQ}, "
              f"{args.steps} timed steps, torch threads {results['torch_threads']}")
        peers = [p for p in args.peers.split(",") if not (args.skip_trl_default and p == "trl_default")]
        sft: dict[str, Any] = {}
        # Interleave repeats and keep each peer's best run: on a shared machine the
        # load of other processes moves single runs by 2x or more.
        for rep in range(args.repeats):
            for name in peers:
                if name == "trl_default" and rep > 0:
                    continue  # ~30x slower; one run is enough to show it
                r = run_peer(name, model_dir, args.steps)
                r["runs"] = sft.get(name, {}).get("runs", 0) + 1
                if name not in sft or "error" in sft[name] or r.get("tokens_per_s", 0) > sft[name]["tokens_per_s"]:
                    sft[name] = r
                else:
                    sft[name]["runs"] = r["runs"]
        for name in peers:
            r = sft[name]
            print(f"  {name:<12} " + (f"{r['tokens_per_s']:8.0f} tok/s  {r['cpu_ms_per_1k_tokens']:6.0f} CPU ms/1k tok  "
                                      f"peak {r['peak_rss_mib']:6.0f} MiB  "
                                      f"(best of {r['runs']})"
                                      if "error" not in r else f"FAILED: {r['error'][-300:]}"))
        results["sft"] = sft
        if "error" not in sft["plain"] and "error" not in sft["kiln"]:
            base = sft["plain"]["tokens_per_s"]
            for name in peers:
                if "error" not in sft[name]:
                    sft[name]["ratio_vs_plain"] = sft[name]["tokens_per_s"] / base
                    sft[name]["cpu_ratio_vs_plain"] = (sft["plain"]["cpu_ms_per_1k_tokens"]
                                                       / sft[name]["cpu_ms_per_1k_tokens"])
            for name in peers:
                if name.startswith("trl") and "error" not in sft[name]:
                    sft["kiln"][f"ratio_vs_{name}"] = sft["kiln"]["tokens_per_s"] / sft[name]["tokens_per_s"]
                    sft["kiln"][f"cpu_ratio_vs_{name}"] = (sft[name]["cpu_ms_per_1k_tokens"]
                                                           / sft["kiln"]["cpu_ms_per_1k_tokens"])
            print("  ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in sft["kiln"].items() if k.startswith("ratio")))

        from kiln.runtime.builtin import BUILTIN_NAME, build_builtin_model

        builtin = build_builtin_model(Path(tmp) / "builtin")
        if not args.skip_grpo:
            grpo: dict[str, Any] = {}
            for _ in range(args.repeats):  # interleaved, best of each kept (see SFT)
                k = bench_grpo(builtin, args.grpo_steps)
                if k["kiln_step_s"] < grpo.get("kiln_step_s", float("inf")):
                    grpo.update(k)
                try:
                    trl_s = bench_trl_grpo(builtin, args.grpo_steps)["trl_step_s_incl_generation"]
                    grpo["trl_step_s_incl_generation"] = min(trl_s, grpo.get("trl_step_s_incl_generation", trl_s))
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    grpo["trl_error"] = f"{type(exc).__name__}: {exc}"[:500]
            results["grpo"] = grpo
            print(f"GRPO (built-in model, {grpo['rows_per_step']} completions/step): Kiln {grpo['kiln_step_s'] * 1000:.0f} ms/step"
                  + (f"; TRL GRPOTrainer {grpo['trl_step_s_incl_generation'] * 1000:.0f} ms/step incl. generation"
                     if "trl_step_s_incl_generation" in grpo else f"; TRL: {grpo.get('trl_error')}"))

        if not args.skip_server:
            home = Path(tmp) / "home"
            (home / "models").mkdir(parents=True)
            os.rename(builtin, home / "models" / BUILTIN_NAME)
            srv = bench_server(home)
            results["server"] = srv
            print(f"correction: submit -> first response from the new adapter {srv['submit_to_first_adapter_response_s']:.2f} s")
            print(f"chat p50/p99 idle {srv['chat_idle_p50_s'] * 1000:.0f}/{srv['chat_idle_p99_s'] * 1000:.0f} ms, "
                  f"during training {srv['chat_training_p50_s'] * 1000:.0f}/{srv['chat_training_p99_s'] * 1000:.0f} ms "
                  f"(p99 ratio {srv['chat_p99_ratio_training_vs_idle']:.2f}x; "
                  f"{srv['training_steps_during_chat']} training steps meanwhile)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
