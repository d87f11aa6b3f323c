"""A Qwen3.5 hybrid of the real 4B shape, random weights, served quantized (issue 42's 24 GB check).

Writes the model to disk shard by shard (one decoder layer, then the embedding, generated and
written and freed in turn: the f32 model, 16.8 GB, is never in memory), then for each of int8 and
int4 starts ``kiln serve --quantize MODE`` on it (one server at a time, training on) and measures:
seconds from the process start until ``/health`` answers, the quantized weight bytes and the probe
KL from ``/v1/config``, the server's resident memory when ready (VmRSS), chat tokens/s at c=1 and
c=4 (greedy, ``--max-tokens`` each), one SFT job of ``--sft-steps`` steps through ``/v1/train/sft``
(wall seconds), and the server's peak resident memory after it all (VmHWM, /proc/<pid>/status).

The shape (``SHAPE_4B``) follows Qwen3.5-4B's published model card ("Model Overview": hidden 2560,
32 layers as 8 x (3 Gated DeltaNet + 1 gated attention), DeltaNet 16 QK / 32 V heads of 128, attention
16 Q / 4 KV heads of 256 with 64 rotary dims, FFN 9216, vocabulary 248,320 tied to the LM head;
docs/serving.md "Quantization" says where each number comes from). Its context is cut to
``max_position_embeddings`` 4096 (the card's 262,144 changes no weight). The tokenizer is Kiln's
built-in one (8,192 tokens; the other embedding rows are zero, as bench/serving.py's shapes).

    .venv/bin/python bench/big_hybrid.py                       # 4B shape, int8 then int4
    .venv/bin/python bench/big_hybrid.py --modes int8 --sft-steps 1
    .venv/bin/python bench/big_hybrid.py --shape small --work /tmp/x   # the slow test's scaled-down run

Random weights: the SFT job shows that training runs over the quantized base within the memory, not
that it learns anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

LAYOUT_4B = (["linear_attention"] * 3 + ["full_attention"]) * 8
SHAPES = {
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=LAYOUT_4B,
               vocab_size=248320, max_position_embeddings=4096,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}),
    # the slow test's: the same layout at a fraction of the width and depth
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                  layer_types=LAYOUT_4B[:4], vocab_size=8192, max_position_embeddings=1024,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}),
}
MARKER = "kiln-big-hybrid-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_model(shape: str, out: Path, home: Path, seed: int = 0) -> Path:
    """``Qwen3_5ForCausalLM`` of ``SHAPES[shape]`` in ``out``: one safetensors shard per decoder layer
    plus one for the embedding and final norm, each generated, written and freed in turn."""
    if (out / MARKER).exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from kiln.runtime.builtin import ensure_builtin_model
    from kiln.runtime.quantize_load import skeleton

    builtin = ensure_builtin_model(home)
    tok = AutoTokenizer.from_pretrained(builtin)
    dims = dict(SHAPES[shape])
    cfg = Qwen3_5TextConfig(**dims, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    meta = skeleton(cfg, torch.float32)  # names, shapes and the model's own _init_weights; no storage
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    n = cfg.num_hidden_layers
    for i in range(n):
        layer = Qwen3_5DecoderLayer(cfg, i)
        for mod in layer.modules():
            meta._init_weights(mod)
        tensors = {f"model.layers.{i}.{k}": v.contiguous() for k, v in layer.state_dict().items()}
        name = f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors"
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del layer, tensors
    emb = torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, cfg.initializer_range)
    textless = [t for t in range(len(tok)) if not tok.decode([t], skip_special_tokens=True) or "\ufffd" in tok.decode([t])]
    emb[len(tok):] = 0.0  # IDs beyond the tokenizer, and tokens without text, never win greedy decoding
    emb[textless] = 0.0
    tensors = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.zeros(cfg.hidden_size)}
    name = f"model-{n + 1:05d}-of-{n + 1:05d}.safetensors"
    save_file(tensors, str(tmp / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in tensors})
    total += sum(t.numel() * t.element_size() for t in tensors.values())
    del emb, tensors
    expected = set(meta.state_dict()) - {"lm_head.weight"}
    if set(weight_map) != expected:
        raise RuntimeError(f"written names differ from the model's: {sorted(set(weight_map) ^ expected)[:4]}")
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (builtin / f).is_file():
            shutil.copy(builtin / f, tmp / f)
    params = sum(p.numel() for p in meta.parameters())
    (tmp / MARKER).write_text(f"{shape}: {params} parameters, {total} bytes f32\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (the peak of VmRSS), RssAnon and RssFile of ``pid`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def chat_rate(base: str, model: str, c: int, requests: int, max_tokens: int) -> float:
    """Completion tokens per wall second of ``requests`` greedy chats, ``c`` at a time."""
    import httpx

    def one(i: int) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=1800)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - t0)


def sft_job(base: str, steps: int, timeout_s: float) -> dict[str, Any]:
    """One SFT job of ``steps`` optimizer steps; its final record and wall seconds."""
    import httpx

    examples = [{"messages": [{"role": "user", "content": f"Which bird guards mill {i}?"},
                              {"role": "assistant", "content": f"Mill {i} is guarded by a heron."}]}
                for i in range(steps)]
    body = {"adapter": "big-sft", "examples": examples, "epochs": 1, "batch_size": 1, "max_steps": steps,
            "until_learned": False, "anchor_weight": 0, "replay_corrections": False,
            "locality": {"measure": False}}
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/train/sft", json=body, timeout=60)
    if r.status_code >= 300:
        raise RuntimeError(f"SFT refused: {r.status_code} {r.text[:400]}")
    job_id = r.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/train/jobs/{job_id}", timeout=60).json()
        if job["state"] in ("failed", "succeeded", "cancelled"):
            return {"state": job["state"], "error": job.get("error"), "seconds": time.perf_counter() - t0,
                    "step": (job.get("progress") or {}).get("step")}
        time.sleep(1.0)
    raise RuntimeError(f"SFT job {job_id} did not finish in {timeout_s} s")


def serve_and_measure(model_dir: Path, mode: str, work: Path, threads: int, max_tokens: int, sft_steps: int,
                      startup_s: float) -> dict[str, Any]:
    """One ``kiln serve --quantize mode`` run (module docstring); the figures."""
    import httpx
    from serving import kiln_env, running_server

    cmd = [str(Path(sys.executable).with_name("kiln")), "serve", "--model", str(model_dir), "--port", "{port}",
           "--quantize", mode, "--threads", str(threads), "--log-level", "warning"]
    # no training warm-up: it has the base model write and answer the anchor's questions (minutes of 4B decoding
    # holding the model) for jobs with the defaults; the SFT job here runs without the anchor and locality probes
    env = kiln_env(work / mode) | {"KILN_TRAINING_WARM_UP": "0"}
    (work / mode).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with running_server(f"kiln-{mode}", cmd, env, work / mode, startup_s) as (base, proc):
        row: dict[str, Any] = {"mode": mode, "ready_s": round(time.perf_counter() - t0, 1)}
        row["rss_ready"] = proc_status(proc.pid)["VmRSS"]
        quant = httpx.get(base + "/v1/config", timeout=60).json()["effective"]["quantization"]
        row.update(weight_bytes=quant["weight_bytes_after"], float_bytes=quant["weight_bytes_before"],
                   probe_kl=quant["probe_kl"], probe_tokens=quant["probe_tokens"], kernel=quant["kernel"],
                   head=quant["head"], layers=quant["layers"])
        model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        chat_rate(base, model, 1, 1, 2)  # warm-up: the first request's one-time costs are not a rate
        row["tok_s_c1"] = round(chat_rate(base, model, 1, 2, max_tokens), 2)
        row["tok_s_c4"] = round(chat_rate(base, model, 4, 4, max_tokens), 2)
        row["sft"] = sft_job(base, sft_steps, 3600)
        end = proc_status(proc.pid)
        row.update(peak_rss=end["VmHWM"], rss_end=end["VmRSS"], rss_file_end=end["RssFile"])
        row["load"] = os.getloadavg()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    ap.add_argument("--modes", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    ap.add_argument("--threads", type=int, default=1, help="kiln serve --threads")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=3)
    ap.add_argument("--startup-s", type=float, default=1800)
    ap.add_argument("--work", type=Path, help="where the model and the servers' homes go (default: a temp dir; "
                                              "the 4B model needs 17 GB of disk)")
    args = ap.parse_args()

    from kiln.config import kiln_home

    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-big-hybrid-"))
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    t0 = time.perf_counter()
    model_dir = write_model(args.shape, work / f"qwen3.5-{args.shape}", kiln_home())
    du = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"model {model_dir} ({(model_dir / MARKER).read_text().strip()}; {du / 2**30:.2f} GiB on disk) "
          f"ready in {time.perf_counter() - t0:.0f} s", flush=True)
    for mode in args.modes:
        row = serve_and_measure(model_dir, mode, work, args.threads, args.max_tokens, args.sft_steps, args.startup_s)
        print(json.dumps(row), flush=True)
        gib = 2 ** 30
        print(f"{mode}: ready {row['ready_s']} s, weights {row['weight_bytes'] / gib:.2f} GiB (f32 "
              f"{row['float_bytes'] / gib:.2f}), probe KL {row['probe_kl']:.3g} over {row['probe_tokens']} tokens, "
              f"RSS ready {row['rss_ready'] / gib:.2f} GiB, chat c=1 {row['tok_s_c1']} c=4 {row['tok_s_c4']} tok/s, "
              f"SFT {row['sft']['state']} step {row['sft']['step']} in {row['sft']['seconds']:.0f} s, "
              f"peak RSS {row['peak_rss'] / gib:.2f} GiB, load {' '.join(f'{v:.2f}' for v in row['load'])}",
              flush=True)


if __name__ == "__main__":
    main()
