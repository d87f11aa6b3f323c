"""Training benchmarks: Kiln's trainer next to its peers, in one run.

    .venv/bin/python bench/training.py                 # everything (TRL default SFTConfig is slow: ~minutes)
    .venv/bin/python bench/training.py --skip-trl-default --steps 10

1. LoRA SFT throughput, peak memory and loss after N steps on two random-weight
   Qwen3 shapes: 4.5M parameters (hidden 256, 4 layers, vocab 4096) and 31M
   (hidden 512, 8 layers, vocab 32000, where the [B, T, V] logits dominate
   activation memory); r=8 on q/k/v/o, batch 8 x 128 tokens, the same random
   token data, batch order, LoRA init and number of timed steps for every peer:
   plain PyTorch + PEFT loop, Kiln's trainer (`kiln.training.sft.job.run_sft` on
   the engine's PEFT wrapping, each step under exclusive ownership; chunked
   head + loss, fused AdamW, packing as an SFT job has it), Kiln without packing
   (`kiln_no_packing`), with gradient checkpointing (`kiln_grad_ckpt`), with the
   compiled trunk (`kiln_compile`; its compile time is in `warmup_s`), Kiln with the full-logits loss
   (`kiln_full_logits`, the previous step) and with AdamW's default foreach
   implementation (`kiln_foreach_adamw`), TRL
   `SFTTrainer` matched (fp32, no gradient checkpointing, constant LR, no
   clipping) and TRL with its default `SFTConfig`. Each peer runs in its own
   subprocess so its peak RSS is its own. The load average is printed before
   and after: ratios from a loaded machine are noisy. `--lengths mixed` gives
   rows of 16 to 128 tokens (batches padded to their longest row; the plain
   loop passes the padding mask); tokens/s always counts real tokens only.
2. GRPO step time (Kiln, built-in model, 4 groups x 8 completions per step;
   also with the full-logits path, `kiln_full_logits_step_s`) and
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
# name -> (vocab, hidden, intermediate, layers, heads, kv heads)
# Which tokens carry the loss: "all", or "half" (the first SEQ // 2 tokens are the prompt, as in chat SFT
# where only the assistant turn is supervised). Set from --loss-on; the child processes get it on argv.
LOSS_ON = {"value": "all"}
# Row lengths: "full" (every row SEQ tokens: no padding anywhere) or "mixed" (each row 1/8 to all of SEQ
# tokens, uniform, as in chat data: batches are padded to their longest row). Set from --lengths.
LENGTHS = {"value": "full"}
SHAPES = {"4.5m": (4096, 256, 896, 4, 4, 2), "31m": (32000, 512, 704, 8, 8, 4)}
SEED = 1234
CHAT_REQUESTS = 50
CHAT_MAX_TOKENS = 16


# ------------------------------------------------------------------ the model


def build_bench_model(out: Path, shape: str = "4.5m") -> Path:
    """A Qwen3 of ``SHAPES[shape]`` with random weights and a word-level tokenizer (offline)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    n_vocab, hidden, inter, layers, heads, kv = SHAPES[shape]
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, n_vocab)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(out)
    torch.manual_seed(SEED)
    cfg = Qwen3Config(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    return out


def bench_data(steps: int, vocab: int = VOCAB) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    rows = torch.randint(2, vocab, (steps * BATCH, SEQ), generator=gen).tolist()
    if LENGTHS["value"] == "mixed":
        cut = torch.randint(SEQ // 8, SEQ + 1, (len(rows),), generator=gen).tolist()
        rows = [r[:n] for r, n in zip(rows, cut)]
    return rows


def loss_mask(n: int) -> list[int]:
    """Which of a row's ``n`` tokens carry loss (``--loss-on``); position 0 never does (no predecessor)."""
    mask = [0] * (n // 2) + [1] * (n - n // 2) if LOSS_ON["value"] == "half" else [1] * n
    mask[0] = 0
    return mask


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _phases(model_dir: Path, steps: int) -> list[list[list[int]]]:
    """Warm-up rows and timed rows, each in the order Kiln's trainer walks them (one epoch, seed SEED)."""
    sys.path.insert(0, str(ROOT / "src"))
    from kiln.training.core.data import epoch_order

    data = bench_data(WARMUP + steps, _vocab(model_dir))
    out = []
    for part in (data[:WARMUP * BATCH], data[WARMUP * BATCH:]):
        out.append([part[i] for i in epoch_order(len(part), seed=SEED, epoch=0)])
    return out


def _load(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ SFT peers


def peer_plain(model_dir: Path, steps: int) -> dict[str, Any]:
    """The plain loop, fed what Kiln's trainer is fed: the same batch order, LoRA init seed and
    a fresh AdamW for the warm-up and for the timed phase (the bench calls ``run_sft`` twice)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = _load(model_dir)
    torch.manual_seed(SEED)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                            lora_dropout=0.0))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    warm, timed = _phases(model_dir, steps)
    t0 = c0 = 0.0
    loss_value = float("nan")
    for phase, data in enumerate((warm, timed)):
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        if phase == 1:
            t0, c0 = time.perf_counter(), time.process_time()
        for i in range(len(data) // BATCH):
            rows = data[i * BATCH:(i + 1) * BATCH]
            width = max(len(r) for r in rows)  # right-padded to the batch's longest row, as a plain loop does
            batch = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            labels = torch.tensor([[t if m else -100 for t, m in zip(r, loss_mask(len(r)))]
                                   + [-100] * (width - len(r)) for r in rows])
            full = bool(attn.all())  # no padding: no mask (the plain causal kernel), as before
            loss = model(input_ids=batch, attention_mask=None if full else attn, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_value = float(loss.detach())
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "loss_after_n": loss_value}


def peer_kiln(model_dir: Path, steps: int, variant: str = "") -> dict[str, Any]:
    import torch

    import kiln.training.core.loop as loop_mod
    import kiln.training.sft.job as sft_mod
    from kiln.runtime.adapter_slots import AdapterSlots
    from kiln.runtime.ownership import AcceleratorOwnership
    from kiln.training.core.data import Row
    from kiln.training.core.loop import Hooks, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.sft.job import run_sft

    if variant == "full_logits":  # the step before the chunked head: model(...).logits + sft_loss
        sft_mod.split_causal_lm = lambda model: None  # type: ignore[assignment]
    elif variant == "foreach_adamw":  # the optimizer before: AdamW's default (foreach) implementation
        loop_mod._adamw = lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # type: ignore[assignment]
    # Step options as a job gets them: packing on (the SFT request default), the others off.
    options = {"packing": variant != "no_packing", "gradient_checkpointing": variant == "grad_ckpt",
               "compile": variant == "compile"}
    ownership = AcceleratorOwnership()
    base = _load(model_dir)
    base.eval()  # as served
    peft_model = AdapterSlots(base, ownership).peft_model()  # the engine's own wrapping
    with ownership.exclusive():
        add_private_adapter(peft_model, "kiln-bench", lora_config(RANK, 2 * RANK, TARGETS), seed=SEED)
    rows = [Row(ids, loss_mask(len(ids))) for ids in bench_data(WARMUP + steps, _vocab(model_dir))]
    hooks = Hooks(exclusive=ownership.exclusive)
    w0 = time.perf_counter()  # the warm-up steps include compiling, with `compile`
    run_sft(peft_model, "kiln-bench", rows[:WARMUP * BATCH], Plan(LR, 1, BATCH, SEED, **options), pad_id=0,
            hooks=hooks)
    warmup_s = time.perf_counter() - w0
    t0, c0 = time.perf_counter(), time.process_time()
    rep = run_sft(peft_model, "kiln-bench", rows[WARMUP * BATCH:], Plan(LR, 1, BATCH, SEED, **options), pad_id=0,
                  hooks=hooks)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "loss_after_n": rep.final_loss, "warmup_s": warmup_s,
            "padded_positions_saved": rep.extra.get("padded_positions_saved", 0)}


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
    ds = Dataset.from_dict({"input_ids": bench_data(WARMUP + steps, _vocab(model_dir))})  # loss on every token
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
    "kiln_full_logits": lambda d, s: peer_kiln(d, s, "full_logits"),
    "kiln_foreach_adamw": lambda d, s: peer_kiln(d, s, "foreach_adamw"),
    "kiln_no_packing": lambda d, s: peer_kiln(d, s, "no_packing"),
    "kiln_grad_ckpt": lambda d, s: peer_kiln(d, s, "grad_ckpt"),
    "kiln_compile": lambda d, s: peer_kiln(d, s, "compile"),
    "trl_matched": lambda d, s: peer_trl(d, s, matched=True),
    "trl_default": lambda d, s: peer_trl(d, s, matched=False),
}


def run_peer(name: str, model_dir: Path, steps: int) -> dict[str, Any]:
    """Run one peer in a fresh interpreter; returns its JSON result."""
    cmd = [sys.executable, __file__, "--peer", name, "--model-dir", str(model_dir), "--steps", str(steps),
           "--loss-on", LOSS_ON["value"], "--lengths", LENGTHS["value"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ GRPO


def bench_grpo(builtin_dir: Path, steps: int, group: int = 8, groups_per_step: int = 4,
               full_logits: bool = False) -> dict[str, Any]:
    import kiln.training.grpo.job as grpo_mod
    from kiln.runtime.adapter_slots import AdapterSlots
    from kiln.runtime.loader import load_model
    from kiln.runtime.ownership import AcceleratorOwnership
    from kiln.training.core.data import tokenize_grpo_group
    from kiln.training.core.loop import Hooks, Plan
    from kiln.training.core.lora import add_private_adapter, lora_config
    from kiln.training.grpo.job import run_grpo
    from kiln.training.grpo.step import GRPOSettings, grpo_items
    from kiln.training.schemas import GRPOGroup

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
    split = grpo_mod.split_causal_lm
    if full_logits:
        grpo_mod.split_causal_lm = lambda model: None  # type: ignore[assignment]
    try:
        rep = run_grpo(peft_model, "kiln-grpo", items, Plan(1e-4, 1, groups_per_step, SEED),
                       GRPOSettings(kl_coef=0.04), pad_id=lm.tokenizer.pad_token_id,
                       hooks=Hooks(exclusive=ownership.exclusive))
    finally:
        grpo_mod.split_causal_lm = split
    return {"kiln_step_s": rep.train_seconds / rep.steps, "steps": rep.steps, "loss_after_n": rep.final_loss,
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


def bench_sft(model_dir: Path, shape: str, peers: list[str], args: Any) -> dict[str, Any]:
    n_params = sum(p.numel() for p in _load(model_dir).parameters())
    print(f"SFT: {shape} shape, {n_params / 1e6:.2f}M-param Qwen3 (vocab {_vocab(model_dir)}), LoRA r={RANK} "
          f"{'/'.join(TARGETS)}, batch {BATCH}x{SEQ} ({args.lengths} rows, loss on {args.loss_on}), "
          f"{args.steps} timed steps, {torch_threads()} torch threads")
    sft: dict[str, Any] = {}
    # Interleave repeats and keep each peer's best run: on a shared machine the
    # load of other processes moves single runs by 2x or more.
    for rep in range(args.repeats):
        for name in peers:
            if name == "trl_default" and rep > 0:
                continue  # ~30x slower; one run is enough to show it
            r = run_peer(name, model_dir, args.steps)
            r["runs"] = sft.get(name, {}).get("runs", 0) + 1
            every = sft.get(name, {}).get("every_run", []) + [
                {k: r.get(k) for k in ("tokens_per_s", "cpu_ms_per_1k_tokens", "peak_rss_mib", "loss_after_n")}]
            if name not in sft or "error" in sft[name] or r.get("tokens_per_s", 0) > sft[name]["tokens_per_s"]:
                sft[name] = r
            else:
                sft[name]["runs"] = r["runs"]
            sft[name]["every_run"] = every  # the spread, reported next to the best run
    plain = sft.get("plain", {})
    for name in peers:
        r = sft[name]
        if "error" in r:
            print(f"  {name:<17} FAILED: {r['error'][-300:]}")
            continue
        if plain and "error" not in plain:
            r["ratio_vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
            r["cpu_ratio_vs_plain"] = plain["cpu_ms_per_1k_tokens"] / r["cpu_ms_per_1k_tokens"]
            r["peak_rss_ratio_vs_plain"] = r["peak_rss_mib"] / plain["peak_rss_mib"]
            if "loss_after_n" in r and "loss_after_n" in plain:
                r["loss_rel_diff_vs_plain"] = abs(r["loss_after_n"] - plain["loss_after_n"]) / abs(plain["loss_after_n"])
        loss = f"loss@{args.steps} {r['loss_after_n']:.6f}" if "loss_after_n" in r else ""
        print(f"  {name:<17} {r['tokens_per_s']:8.0f} tok/s ({r.get('ratio_vs_plain', float('nan')):.2f}x)  "
              f"{r['cpu_ms_per_1k_tokens']:6.0f} CPU ms/1k tok  peak {r['peak_rss_mib']:6.0f} MiB "
              f"({r.get('peak_rss_ratio_vs_plain', float('nan')):.2f}x)  {loss}  (best of {r['runs']})")
    kiln = sft.get("kiln", {})
    if "error" not in kiln and kiln:
        for name in peers:
            if name.startswith("trl") and "error" not in sft[name]:
                kiln[f"ratio_vs_{name}"] = kiln["tokens_per_s"] / sft[name]["tokens_per_s"]
                kiln[f"cpu_ratio_vs_{name}"] = sft[name]["cpu_ms_per_1k_tokens"] / kiln["cpu_ms_per_1k_tokens"]
        print("  kiln ratios: " + ", ".join(f"{k}={v:.3g}" for k, v in kiln.items()
                                           if k.startswith(("ratio", "peak_rss_ratio", "loss_rel"))))
    return {"params": n_params, "vocab": _vocab(model_dir), "peers": sft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed SFT steps per peer (after 2 warm-up steps)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per SFT peer (best one is kept)")
    ap.add_argument("--grpo-steps", type=int, default=3)
    ap.add_argument("--skip-trl-default", action="store_true", help="skip TRL's default SFTConfig (slow on CPU)")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-grpo", action="store_true")
    ap.add_argument("--skip-sft", action="store_true")
    ap.add_argument("--peers", default="plain,kiln,kiln_full_logits,kiln_grad_ckpt,trl_matched,trl_default",
                    help="SFT peers to run (comma list)")
    ap.add_argument("--shapes", default="4.5m,31m", help=f"SFT model shapes (comma list of {', '.join(SHAPES)})")
    ap.add_argument("--loss-on", choices=["all", "half"], default="all",
                    help="SFT loss on every token, or on the second half only (a prompt/answer split); "
                         "TRL peers always train on every token")
    ap.add_argument("--lengths", choices=["full", "mixed"], default="full",
                    help="every row SEQ tokens, or each row 1/8 to all of SEQ (chat-like; batches get padding)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    LOSS_ON["value"] = args.loss_on
    LENGTHS["value"] = args.lengths

    if args.peer:  # child process: one SFT peer
        result = PEERS[args.peer](args.model_dir, args.steps)
        tokens = sum(len(r) for r in bench_data(WARMUP + args.steps, _vocab(args.model_dir))[WARMUP * BATCH:])
        result.update(tokens_per_s=tokens / result["seconds"], cpu_ms_per_1k_tokens=1e6 * result["cpu_seconds"] / tokens,
                      peak_rss_mib=_peak_mib())
        print(json.dumps(result))
        return

    sys.path.insert(0, str(ROOT / "src"))
    import torch

    results: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "steps": args.steps, "loss_on": args.loss_on, "lengths": args.lengths,
                               "batch": BATCH, "seq": SEQ, "rank": RANK}
    results["load_average_start"] = list(os.getloadavg())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        peers = [p for p in args.peers.split(",") if not (args.skip_trl_default and p == "trl_default")]
        results["sft_shapes"] = {}
        for shape in [] if args.skip_sft else args.shapes.split(","):
            model_dir = build_bench_model(Path(tmp) / f"qwen3-{shape}", shape)
            results["sft_shapes"][shape] = bench_sft(model_dir, shape, peers, args)
        if results["sft_shapes"]:
            results["sft"] = results["sft_shapes"][args.shapes.split(",")[0]]["peers"]  # the first shape, as before

        from kiln.runtime.builtin import BUILTIN_NAME, build_builtin_model

        builtin = build_builtin_model(Path(tmp) / "builtin")
        if not args.skip_grpo:
            grpo: dict[str, Any] = {}
            for _ in range(args.repeats):  # interleaved, best of each kept (see SFT)
                k = bench_grpo(builtin, args.grpo_steps)
                if k["kiln_step_s"] < grpo.get("kiln_step_s", float("inf")):
                    grpo.update(k)
                f = bench_grpo(builtin, args.grpo_steps, full_logits=True)
                if f["kiln_step_s"] < grpo.get("kiln_full_logits_step_s", float("inf")):
                    grpo["kiln_full_logits_step_s"] = f["kiln_step_s"]
                    grpo["kiln_full_logits_loss_after_n"] = f["loss_after_n"]
                try:
                    trl_s = bench_trl_grpo(builtin, args.grpo_steps)["trl_step_s_incl_generation"]
                    grpo["trl_step_s_incl_generation"] = min(trl_s, grpo.get("trl_step_s_incl_generation", trl_s))
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    grpo["trl_error"] = f"{type(exc).__name__}: {exc}"[:500]
            results["grpo"] = grpo
            print(f"GRPO (built-in model, {grpo['rows_per_step']} completions/step): Kiln {grpo['kiln_step_s'] * 1000:.0f} ms/step"
                  f" (full logits {grpo['kiln_full_logits_step_s'] * 1000:.0f} ms/step; loss@{grpo['steps']} "
                  f"{grpo['loss_after_n']:.6f} vs {grpo['kiln_full_logits_loss_after_n']:.6f})"
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
    results["load_average_end"] = list(os.getloadavg())
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
