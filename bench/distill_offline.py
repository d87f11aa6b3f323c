"""Offline distillation benchmarks (autodistill v1, Milestone B), ratios from one run.

    .venv/bin/python bench/distill_offline.py [--examples 16] [--target 112] [--top-k 32] [--device cpu]
        [--teacher-hidden 256 --teacher-layers 4]   # 512/8 shows a teacher whose forward dominates more

Models are built offline: a 4.5M-parameter Qwen3 teacher (hidden 256, 4 layers,
vocab 4096) and a 1.2M student (hidden 128, 2 layers) sharing one tokenizer.

1. Capture throughput vs a bare teacher forward pass over the same tokens and
   batches: (a) the scorer alone (forward + float64 normalizer + top-k + entropy
   + host copy), (b) scorer + packed encoding + write-last publication +
   re-verification (everything the child does after the model is loaded).
   Target: overhead <= 10%.
2. Bytes/token of the packed layout vs the plan's sparse_upper_bytes / N and vs
   dense (V x B_logp); JSONL for comparison.
3. Sparse-KD step (CE + coarse-tail KL, LoRA r=8) vs a CE-only step on the same
   tokens. Target: <= 1.15x.
4. A KD step through full ``[B, T, V]`` logits vs the chunked LM head
   (``kiln.training.losses.kd.linear_sparse_kd``): step time and peak RSS, one
   process per variant (``--kd-vocab 32768 --kd-hidden 256``; ``--only-kd-memory``).

The quality comparison on a synthetic task is shared with the OPD issue and is
not run here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kd_step_child(variant: str, vocab: int, hidden: int, batch: int, seq: int, top_k: int, steps: int) -> dict:
    """One process per variant (peak RSS is per process): LoRA KD steps on a random student, either through
    full logits (``model(...).logits[rows, offs]`` + SparseKDLoss) or the chunked head (kd_step_loss)."""
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kiln.training.losses.kd_batch import kd_step_loss
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.losses.kd import SparseKDLoss

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=False)
    model = get_peft_model(Qwen3ForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq))
    att = torch.ones_like(ids)
    rows = torch.arange(batch).repeat_interleave(seq - 1)
    offs = torch.arange(seq - 1).repeat(batch)
    n = rows.numel()
    sel = torch.cat([torch.randint(0, vocab, (n, top_k)), ids[rows, offs + 1][:, None]], -1)
    lp = torch.log_softmax(torch.randn(n, top_k + 1), -1).double() - 0.1
    mask = torch.ones(n, top_k + 1, dtype=torch.bool)
    mask[:, -1] = False
    tail = 1 - lp.exp().sum(-1) + lp[:, -1].exp()
    target = ids[rows, offs + 1]
    loss_fn = SparseKDLoss()
    split = split_causal_lm(model) if variant == "chunked" else None
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, _parts = kd_step_loss(model, split, loss_fn, ids, att, rows, offs, sel, lp, mask, tail, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(round(float(loss), 6))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "step_s_median": round(statistics.median(times[1:] or times), 4),
            "peak_rss_mib": round(peak / 1024, 1), "peak_rss_over_setup_mib": round((peak - base_rss) / 1024, 1),
            "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--target", type=int, default=112)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--teacher-hidden", type=int, default=256)
    ap.add_argument("--teacher-layers", type=int, default=4)
    ap.add_argument("--kd-vocab", type=int, default=32768, help="KD step memory section: student vocabulary")
    ap.add_argument("--kd-hidden", type=int, default=256)
    ap.add_argument("--kd-steps", type=int, default=5)
    ap.add_argument("--kd-step-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only-kd-memory", action="store_true", help="run only section 4")
    args = ap.parse_args()
    if args.kd_step_child:
        print(json.dumps(kd_step_child(args.kd_step_child, args.kd_vocab, args.kd_hidden, args.batch, 128,
                                       args.top_k, args.kd_steps)))
        return
    kd_memory = _kd_memory(args)
    if args.only_kd_memory:
        print(json.dumps(kd_memory, indent=2))
        return

    import torch

    from kiln.distill import shards
    from kiln.distill.capture import LocalTeacherScorer, _encode, _payload_name, load_examples, pad_windows
    from kiln.distill.examples import available_shards, forward_windows, load_shard_examples
    from kiln.training.losses.kd_batch import batch_tensors
    from kiln.training.losses.kd import SparseKDLoss
    from tests.distill.tinymodels import build_tiny_model, capture_in_process, make_plan, synthetic_examples

    vocab = 4096
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-distill-"))
    teacher = build_tiny_model(tmp / "teacher", vocab=vocab, seed=0, hidden=args.teacher_hidden, layers=args.teacher_layers)
    student = build_tiny_model(tmp / "student", vocab=vocab, seed=1, hidden=128, layers=2, tokenizer_from=teacher)
    examples = synthetic_examples(args.examples, vocab, prompt=args.prompt, target=args.target)
    plan_path, plan, data = make_plan(tmp, teacher, student, examples, top_k=args.top_k, max_len=args.prompt + args.target)
    n_tokens = plan.capture.planned_tokens
    exs = load_examples(data, plan)
    items = [(e.example_id, e.prompt_token_ids, e.target_token_ids) for e in exs]
    scorer = LocalTeacherScorer(plan, teacher, device=args.device, batch_size=args.batch)
    model = scorer.model

    # --- 1. capture vs bare forward (same windows, same batch size)
    windows = scorer._windows(items)

    def bare():
        for b0 in range(0, len(windows), args.batch):
            ids, att = pad_windows(windows[b0 : b0 + args.batch], scorer.device)
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=att).logits.float()

    def score_only():
        scorer.score(items)

    counter = iter(range(10**6))

    def score_and_publish():
        root = tmp / "pub"
        txn = shards.begin(root, plan, "bench", f"bench.t{next(counter):03d}")
        chunk = args.batch
        for j in range(0, len(items), chunk):
            shards.write_payload_bytes(txn, _payload_name(j // chunk, "packed"),
                                       _encode(plan, scorer.score(items[j : j + chunk]), "packed"))
        shards.mark_complete(txn)
        shards.mark_verified(txn)
        shards.publish(txn, root)

    bare()  # warm-up
    score_only()
    t_bare, t_score, t_pub = [], [], []
    c_bare, c_score = [], []  # CPU seconds (process_time): less sensitive to other load on the machine
    for _ in range(args.reps):  # interleaved so drift hits every peer alike
        c0 = time.process_time()
        t_bare.append(_median_time(bare, 1))
        c1 = time.process_time()
        t_score.append(_median_time(score_only, 1))
        c2 = time.process_time()
        t_pub.append(_median_time(score_and_publish, 1))
        c_bare.append(c1 - c0)
        c_score.append(c2 - c1)
    tb, ts, tp = statistics.median(t_bare), statistics.median(t_score), statistics.median(t_pub)

    # --- 2. bytes/token (packed and JSONL) from verified shards
    out_packed, out_jsonl = tmp / "run-packed", tmp / "run-jsonl"
    capture_in_process(tmp, teacher, plan_path, data, out_packed, examples_per_shard=args.examples,
                       examples_per_payload=args.batch, batch_size=args.batch)
    capture_in_process(tmp, teacher, plan_path, data, out_jsonl, examples_per_shard=args.examples,
                       examples_per_payload=args.batch, batch_size=args.batch, layout="jsonl")
    bpt = {}
    for name, out in (("packed", out_packed), ("jsonl", out_jsonl)):
        verdicts = [shards.verify_shard(d) for d in sorted(out.iterdir()) if not d.name.startswith(".")]
        bpt[name] = shards.run_bytes_per_token(verdicts)["bytes_per_token"]
    planned = bpt["packed"]["planned_sparse_upper"]
    dense = bpt["packed"]["planned_dense"]

    # --- 3. sparse-KD step vs CE-only step (LoRA r=8 on q/k/v/o), same tokens
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    plan_, todo, _ = available_shards(out_packed)
    shard_dir, head = todo[0]
    sexs = load_shard_examples(shard_dir, head, plan_)
    swin = forward_windows(sexs, plan_.capture.max_sequence_length)[: args.batch]
    tensors = batch_tensors(swin, sexs, args.top_k, vocab, "cpu", True)
    smodel = get_peft_model(
        AutoModelForCausalLM.from_pretrained(student),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    opt = torch.optim.AdamW([p for p in smodel.parameters() if p.requires_grad], lr=1e-4)
    kd_loss = SparseKDLoss(ce_weight=1.0, kd_weight=1.0)
    ids, att, rows, offs, sel, lp, mask, tail, target = tensors

    def step(kd: bool):
        logits = smodel(input_ids=ids, attention_mask=att).logits[rows, offs]
        if kd:
            loss, _ = kd_loss(logits, sel, lp, mask, tail, target)
        else:
            loss = torch.nn.functional.cross_entropy(logits.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step(True), step(False)
    t_kd, t_ce = [], []
    for _ in range(max(11, args.reps * 3)):
        t_ce.append(_median_time(lambda: step(False), 1))
        t_kd.append(_median_time(lambda: step(True), 1))
    tk, tc = statistics.median(t_kd), statistics.median(t_ce)

    result = {
        "tokens": n_tokens,
        "teacher_hidden_layers": [args.teacher_hidden, args.teacher_layers],
        "top_k": args.top_k,
        "vocab": vocab,
        "torch_threads": torch.get_num_threads(),
        "capture_scorer_vs_bare_forward": round(ts / tb, 3),
        "capture_scorer_plus_publication_vs_bare_forward": round(tp / tb, 3),
        "capture_scorer_vs_bare_forward_cpu_time": round(statistics.median(c_score) / statistics.median(c_bare), 3),
        "capture_scorer_vs_bare_forward_cpu_time_min": round(min(c_score) / min(c_bare), 3),
        "bare_forward_tokens_per_s": round(n_tokens / tb, 1),
        "bytes_per_token_packed": bpt["packed"]["observed"],
        "bytes_per_token_jsonl": bpt["jsonl"]["observed"],
        "planned_sparse_upper_per_token": planned,
        "planned_dense_per_token": dense,
        "packed_vs_sparse_upper": round(bpt["packed"]["observed"] / planned, 4),
        "packed_vs_dense": round(bpt["packed"]["observed"] / dense, 4),
        "jsonl_vs_sparse_upper": round(bpt["jsonl"]["observed"] / planned, 3),
        "kd_step_vs_ce_step": round(tk / tc, 3),
        "kd_step_tokens": int(rows.numel()),
        "kd_step_memory": kd_memory,
    }
    print(json.dumps(result, indent=2))


def _kd_memory(args) -> dict:
    """4. KD step through full logits vs the chunked head, each variant in its own process (peak RSS)."""
    import subprocess

    out = {}
    for variant in ("logits", "chunked"):
        proc = subprocess.run([sys.executable, __file__, "--kd-step-child", variant, "--kd-vocab", str(args.kd_vocab),
                               "--kd-hidden", str(args.kd_hidden), "--batch", str(args.batch), "--top-k",
                               str(args.top_k), "--kd-steps", str(args.kd_steps)],
                              capture_output=True, text=True, check=True)
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["shape"] = {"vocab": args.kd_vocab, "hidden": args.kd_hidden, "batch": args.batch, "seq": 128,
                    "top_k": args.top_k}
    out["chunked_vs_logits_step_time"] = round(out["chunked"]["step_s_median"] / out["logits"]["step_s_median"], 3)
    out["chunked_vs_logits_peak_rss"] = round(out["chunked"]["peak_rss_mib"] / out["logits"]["peak_rss_mib"], 3)
    return out


if __name__ == "__main__":
    main()
