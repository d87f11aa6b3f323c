"""Serving benchmark: Kiln's server next to transformers (and vLLM when available), same model and prompts.

Every system generates exactly ``--max-tokens`` tokens per request (Kiln and vLLM
with ``ignore_eos``; transformers with ``min_new_tokens``), so tokens/s compare
like for like. Peers, in one run:

* ``hf-seq``: transformers ``generate``, one prompt at a time;
* ``hf-static-B``: ``generate`` on left-padded batches of B prompts (B = each concurrency > 1);
* ``hf-cb``: transformers' own continuous batching (``generate_batch``), with ``--hf-cb``;
* ``kiln-cC``: ``kiln serve`` as a subprocess, C concurrent streaming HTTP clients;
* ``vllm-cC``: vLLM's OpenAI server (``--dtype float32``) when ``--vllm-venv`` exists;
* ``llamacpp-f32-cC``: llama.cpp's server over an f32 GGUF, with ``--llamacpp`` (bench/peers/llamacpp.py
  builds it and converts the model; Qwen3.5 hybrids included; skipped saying why where it cannot).

* ``engine-cC``: Kiln's engine in process without HTTP (C client threads), to
  separate the scheduler's cost from the HTTP/SSE path's.

TTFT is request start to first content chunk; ITL is the gap between consecutive
content chunks of a stream (a chunk may carry more than one token when the
client falls behind). ``CPU ms/tok`` is CPU time (server process tree plus the
benchmark's own client) per generated token: on a shared machine whose other
tenants steal cores it is steadier than wall-clock tokens/s. Output: a table,
the ratios, and ``--json`` if given.

    .venv/bin/python bench/serving.py                  # built-in model, concurrency 1 8 32
    .venv/bin/python bench/serving.py --shape qwen3-31m  # 31M-parameter Qwen3 shape, random weights
    .venv/bin/python bench/serving.py --prefix-only      # prefix cache: TTFT with a cached 1,000-token system prompt
    .venv/bin/python bench/serving.py --structured-only  # JSON-schema output vs unconstrained at c=8, mask cost
    .venv/bin/python bench/serving.py --shape qwen3-31m --mixed-only  # mixed_step_factor 0 vs default
    .venv/bin/python bench/serving.py --shape qwen3-31m --concurrency 1 8 --ab "--prefill-threads 1"  # A/B a flag
    .venv/bin/python bench/serving.py --concurrency 8 32 --ab-rev HEAD~1   # A/B this tree against a revision

``--structured-only``: one ``kiln serve``, streaming chat at ``--structured-concurrency``
(default 8), the same prompts unconstrained and with ``response_format: json_schema``
(``--structured-rounds`` interleaved A/B rounds), tokens/s ratio best-of-each and the
median of the rounds' ratios (target >= 0.85x), and CPU time per token of each; and, in
process, the grammar mask's cost per token computed in line (llguidance fill + apply on
one row) next to the batched sampler's cost per step with none, one or all rows
constrained (masks prepared on the worker thread while a stand-in forward runs).

``--mixed-only``: ``kiln serve`` with ``batching.mixed_step_factor`` 0 (no limit on a cycle's
prompt tokens beside decoding rows) and with its default, ``--mixed-rounds`` interleaved
rounds, ``--mixed-concurrency`` closed-loop clients whose requests ask for varied output
lengths (uniform in [1/4, 7/4] of ``--max-tokens``, seeded), so streams end out of step and
each new prompt is prefilled beside running rows: ITL p50/p99 and TTFT of both settings.

``--shape`` builds a model offline (the built-in tokenizer, a ``Qwen3Config`` of that
shape, random weights, safetensors) into ``$KILN_HOME/bench-models/<shape>``; ``--model``
takes any local model directory. vLLM gets ``--max-model-len`` from the model's own
``max_position_embeddings`` (it refuses a longer one); Kiln caps its own limit there too.
``bench/vllm_serve_client.py`` runs vLLM's own benchmark client against both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["France", "Spain", "the river", "the mountain", "Italy", "the sea", "Germany", "the forest",
          "Japan", "the city", "Egypt", "the moon", "Peru", "the desert", "Norway", "the island"]
TEMPLATES = ["What is the capital of {}?", "Tell me about {}.", "Write a short note on {} for a child.",
             "Why do people visit {}?"]


SHAPES = {  # --shape: Qwen3 shapes built offline with random weights (speed does not depend on the weights)
    "qwen3-31m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, vocab_size=8192, max_position_embeddings=1024),
    # issue 42's real-vocabulary shape: 4 layers of hidden 256 with the Qwen3 vocabulary size (151,936; the built-in
    # tokenizer's tokens, the other embedding rows zero): 42M parameters, 39M of them the tied embedding
    "qwen3-42m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=64, vocab_size=151936, max_position_embeddings=1024),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096),
    # Qwen3.5 hybrids (Qwen3_5TextConfig): 3 Gated DeltaNet layers to 1 full-attention layer
    "qwen3.5-hybrid-25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                               linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, vocab_size=8192,
                               max_position_embeddings=1024),
    # issue 41's ~100M hybrid: the 25M layer stack with the Qwen3 vocabulary size (151,936; the built-in tokenizer's
    # tokens, the other embedding rows zero)
    "qwen3.5-hybrid-100m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, vocab_size=151936,
                                max_position_embeddings=1024),
    "qwen3.5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, vocab_size=248320,
                         max_position_embeddings=4096),
}


SHAPE_MARKER = "kiln-bench-shape-v3"  # models built before it streamed mostly textless tokens: rebuilt


def build_shape_model(shape: str, home: Path) -> Path:
    """A Qwen3 model (a Qwen3.5 hybrid when the shape has ``layer_types``) of ``SHAPES[shape]`` with
    the built-in tokenizer and random weights (cached).

    The embedding rows (tied to the LM head) of IDs without text of their own are zero: the IDs
    beyond the built-in tokenizer (the shape's vocabulary is larger), special tokens, and byte
    tokens that are not a whole UTF-8 character alone (a streaming detokenizer holds those back).
    So greedy decoding picks tokens that have text and both servers stream content every step
    (TTFT and ITL are measured on content chunks; a random model that locks onto a lone
    continuation byte streams nothing for many steps)."""
    out = home / "bench-models" / shape
    if (out / SHAPE_MARKER).exists():
        return out
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from kiln.runtime.builtin import ensure_builtin_model

    builtin = ensure_builtin_model(home)
    tok = AutoTokenizer.from_pretrained(builtin)
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = max(dims["vocab_size"], len(tok))
    hybrid = "layer_types" in dims
    config_cls, model_cls = (Qwen3_5TextConfig, Qwen3_5ForCausalLM) if hybrid else (Qwen3Config, Qwen3ForCausalLM)
    rope = {} if hybrid else {"rope_theta": 1_000_000.0}  # hybrids: Qwen3_5TextConfig's own (partial) RoPE
    cfg = config_cls(**dims, **rope, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = model_cls(cfg)
    textless = [i for i in range(len(tok))
                if not tok.decode([i], skip_special_tokens=True) or "\ufffd" in tok.decode([i])]
    with torch.no_grad():
        model.get_input_embeddings().weight[len(tok):] = 0.0
        model.get_input_embeddings().weight[textless] = 0.0
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / SHAPE_MARKER).write_text(f"textless vocabulary rows zeroed: {len(textless)} + {cfg.vocab_size - len(tok)}\n")
    tok.model_max_length = dims["max_position_embeddings"]
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def model_max_len(model_dir: Path) -> int:
    """The model's ``max_position_embeddings`` from its config.json: vLLM refuses a longer
    ``--max-model-len``, and Kiln caps ``limits.max_model_len`` at it."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["max_position_embeddings"])


def resolve_model(model: str | None, shape: str | None) -> Path:
    """``--model`` as given, else ``--shape`` built offline, else the built-in model (built if missing)."""
    from kiln.config import kiln_home

    if model:
        return Path(model).resolve()
    if shape:
        return build_shape_model(shape, kiln_home())
    from kiln.runtime.builtin import ensure_builtin_model

    return ensure_builtin_model(kiln_home())


def kiln_command(model_dir: Path, threads: int) -> list[str]:
    """``kiln serve`` with its defaults (``threads`` > 0 overrides ``model.threads``)."""
    cmd = [str(Path(sys.executable).with_name("kiln")), "serve", "--model", str(model_dir), "--port", "{port}",
           "--no-training", "--log-level", "warning"]
    return cmd + (["--threads", str(threads)] if threads else [])


def kiln_env(workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_HOME"] = str(workdir / "home")
    return env


def vllm_command(vpy: Path, model_dir: Path) -> list[str]:
    """vLLM's OpenAI server in fp32 (its bf16 default is emulated slowly on these CPUs), with the
    model's own length limit."""
    return [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", model_dir.name, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", "{port}", "--max-model-len", str(model_max_len(model_dir))]


def vllm_env(threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def prefix_runs(model_dir: Path, system_tokens: int = 1000, repeats: int = 5) -> list[dict]:
    """TTFT of a request whose ~``system_tokens``-token system prompt is new (cold) vs already
    cached by an earlier request with a different question (warm). Engine in process, one at a time."""
    from kiln.runtime.builtin import corpus_text
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams

    loaded = load_model(model_dir)
    max_len = min(EngineConfig.max_model_len, model_max_len(model_dir))
    system_tokens = min(system_tokens, max_len - 100)  # room for the template, question and output
    engine = Engine(loaded, EngineConfig(max_model_len=max_len)).start()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    words = corpus_text().split()
    base = engine.encode_text(" ".join(words[:system_tokens * 2]))[:system_tokens]
    system = engine.tokens.tokenizer.decode(base)

    def ttft(sys_text: str, question: str) -> tuple[float, int]:
        ids = engine.encode_chat([{"role": "system", "content": sys_text}, {"role": "user", "content": question}])
        t0 = time.perf_counter()
        sub = engine.submit(ids, [params], incremental=True)
        sub.streams[0].next_chunk_sync(120)
        dt = time.perf_counter() - t0
        sub.cancel()
        return dt, len(ids)

    try:
        ttft(system, "warm-up")
        cold, warm, n = [], [], 0
        for i in range(repeats):
            dt, n = ttft(f"Session {i}. " + system, f"What is the capital of {TOPICS[i]}?")  # a new prefix
            cold.append(dt)
            dt, _ = ttft(f"Session {i}. " + system, f"Why do people visit {TOPICS[i + 1]}?")  # same prefix, cached
            warm.append(dt)
        stats = engine.stats()
    finally:
        engine.stop()
    c, w = pct(cold, 50), pct(warm, 50)
    return [{"system": "prefix-cold", "prompt_tokens": n, "ttft_ms": 1000 * c},
            {"system": "prefix-cached", "prompt_tokens": n, "ttft_ms": 1000 * w, "ratio": w / c,
             "hit_blocks": stats["prefix_cache_hit_blocks"]}]


def prompts_for(count: int) -> list[str]:
    return [TEMPLATES[i % len(TEMPLATES)].format(TOPICS[(i * 7) % len(TOPICS)]) for i in range(count)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of ``pid`` and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, frontier = 0.0, [pid]
    while frontier:
        cur = frontier.pop()
        if cur in stats:
            total += stats[cur][1]
        frontier.extend(p for p, (ppid, _) in stats.items() if ppid == cur)
    return total


# -- transformers peers -------------------------------------------------------------------


def hf_runs(model_dir: Path, texts: list[str], max_tokens: int, batch_sizes: list[int], seq_count: int,
            with_cb: bool) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
              pad_token_id=tok.pad_token_id)
    out = []
    with torch.inference_mode():
        enc = tok(chats[:1], return_tensors="pt", add_special_tokens=False)
        model.generate(**enc, **kw)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        for c in chats[:seq_count]:
            enc = tok([c], return_tensors="pt", add_special_tokens=False)
            model.generate(**enc, **kw)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = seq_count * max_tokens
        out.append({"system": "hf-seq", "concurrency": 1, "tok_s": n / dt, "cpu_ms_per_tok": 1000 * cpu / n})
        for b in batch_sizes:
            t0, c0 = time.perf_counter(), time.process_time()
            n = 0
            for i in range(0, len(chats) - b + 1, b):
                enc = tok(chats[i:i + b], return_tensors="pt", padding=True, add_special_tokens=False)
                g = model.generate(**enc, **kw)
                n += (g.shape[1] - enc["input_ids"].shape[1]) * b
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            out.append({"system": f"hf-static-{b}", "concurrency": b, "tok_s": n / dt,
                        "cpu_ms_per_tok": 1000 * cpu / n})
    if with_cb:  # its manager thread must not see inference-mode tensors, so outside inference_mode
        ids = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
        cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=-1, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            res = model.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = sum(len(r.generated_tokens) for r in res.values())
        out.append({"system": "hf-cb", "concurrency": len(ids), "tok_s": n / dt, "cpu_ms_per_tok": 1000 * cpu / n})
    return out


def engine_runs(model_dir: Path, texts_by_c: dict, max_tokens: int, compiled: bool = False,
                threads: int = 0) -> list[dict]:
    """Kiln's engine in process, no HTTP: C client threads, each waiting for its completion.
    ``compiled``: the torch.compile'd decode step; every run is done once untimed first, so
    its buckets are compiled, and that warm-up time is reported as ``compile_s``."""
    import threading

    import torch

    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.runtime.sampling import SamplingParams
    from kiln.runtime.threads import default_threads

    if threads == 0:  # as `kiln serve` does with model.threads = 0
        torch.set_num_threads(default_threads())
    max_len = min(EngineConfig.max_model_len, model_max_len(model_dir))  # as `kiln serve` caps it
    engine = Engine(load_model(model_dir), EngineConfig(max_model_len=max_len, compile_decode=compiled)).start()
    name = "engine-compiled" if compiled else "engine"
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = []
    try:
        for c, texts in texts_by_c.items():
            prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]
            engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
            lock = threading.Lock()
            warm_s = 0.0
            if compiled:  # compile this concurrency's buckets outside the timed run
                t0 = time.perf_counter()
                warm = [threading.Thread(target=engine.generate, args=(p, params)) for p in prompts[:c]]
                for t in warm:
                    t.start()
                for t in warm:
                    t.join()
                warm_s = time.perf_counter() - t0

            def worker(prompts=list(prompts), lock=lock):
                while True:
                    with lock:
                        if not prompts:
                            return
                        prompt = prompts.pop()
                    engine.generate(prompt, params)

            t0, c0 = time.perf_counter(), time.process_time()
            threads = [threading.Thread(target=worker) for _ in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = len(texts) * max_tokens
            out.append({"system": f"{name}-c{c}", "concurrency": c, "tok_s": n / dt, "cpu_ms_per_tok": 1000 * cpu / n})
            if compiled:
                out[-1]["compile_s"] = warm_s
                print(f"{name}-c{c}: warm-up (compiling buckets) {warm_s:.1f} s", file=sys.stderr)
    finally:
        engine.stop()
    return out


# -- HTTP load (Kiln and vLLM) -----------------------------------------------------------------


CONTENT_EVENT = re.compile(rb'"(?:delta":\{"content|text)":"[^"]')  # a non-empty text delta
USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def one_request(host: str, port: int, model: str, text: str, max_tokens: int,
                      extra: dict | None = None) -> dict:
    """Stream one chat completion over a raw socket; timestamps every read that carries new text.

    The client is deliberately minimal (no HTTP library, no JSON per event, a regex on raw
    bytes): it shares the machine's cores with the server it measures, for every server alike.
    """
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra or {})}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    first = last = None
    gaps: list[float] = []
    tail = b""
    try:
        writer.write(head + body)
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{status!r}: {await reader.read(4096)!r}")
        while True:
            raw = await reader.read(65536)
            if not raw:
                break
            if CONTENT_EVENT.search(raw):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            tail = (tail + raw)[-1024:]
            if b"data: [DONE]" in tail:
                break
    finally:
        writer.close()
    m = USAGE.search(tail)
    if m is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {"ttft": (first or time.perf_counter()) - t0, "gaps": gaps, "tokens": int(m.group(1))}


async def http_load(base_url: str, model: str, texts: list[str], max_tokens: int | list[int], concurrency: int,
                    extra: dict | None = None) -> dict:
    """``concurrency`` closed-loop clients over ``texts``; ``max_tokens`` is one count for every
    request or one per text (streams then end out of step, so prompts join running batches)."""
    host, port = base_url.rsplit("//", 1)[1].rsplit(":", 1)
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(texts)
    queue = list(zip(texts, counts))
    results: list[dict] = []
    await one_request(host, int(port), model, texts[0], 4, extra)  # warm-up

    async def worker():
        while queue:
            text, count = queue.pop()
            results.append(await one_request(host, int(port), model, text, count, extra))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "tok_s": tokens / dt,
        "ttft_p50_ms": 1000 * pct(ttfts, 50),
        "ttft_p99_ms": 1000 * pct(ttfts, 99),
        "itl_p50_ms": 1000 * pct(gaps, 50),
        "itl_p99_ms": 1000 * pct(gaps, 99),
    }


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_server(name: str, cmd: list[str], env: dict, workdir: Path, startup_s: float):
    """Start ``cmd`` (``{port}`` replaced by a free port), wait for ``/health``, yield
    ``(base URL, process)``; the process (and only it, by PID) is stopped on exit."""
    port = free_port()
    cmd = [a.replace("{port}", str(port)) for a in cmd]
    log = workdir / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base + "/health", startup_s, log)
        yield base, proc
    finally:
        stop(proc)


def server_runs(name: str, cmd: list[str], env: dict, model_id: str, texts_by_c: dict,
                max_tokens: int, workdir: Path, startup_s: float) -> list[dict]:
    with running_server(name, cmd, env, workdir, startup_s) as (base, proc):
        out = []
        for c, texts in texts_by_c.items():
            s0, c0 = tree_cpu_s(proc.pid), time.process_time()
            r = asyncio.run(http_load(base, model_id, texts, max_tokens, c))
            cpu = tree_cpu_s(proc.pid) - s0 + time.process_time() - c0
            r["cpu_ms_per_tok"] = 1000 * cpu / max(1, r["tokens"])
            out.append({"system": f"{name}-c{c}", **r})
            print(f"  {name} c={c}: {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        return out


def llamacpp_runs(model_dir: Path, threads: int, texts_by_c: dict, max_tokens: int, workdir: Path) -> list[dict]:
    """llama.cpp's server over the model's f32 GGUF (bench/peers/llamacpp.py: ``-np`` the highest
    concurrency, ``-t`` = ``threads``), or no rows with the reason printed."""
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    from llamacpp import PeerUnavailable, convert, server_command, server_env

    try:
        gguf = convert(model_dir, types=())["F32"]
        cmd = server_command(gguf, threads or os.cpu_count() or 1, max(texts_by_c), model_max_len(model_dir),
                             model_dir.name)
    except PeerUnavailable as exc:
        print(f"llama.cpp peer skipped: {exc}", file=sys.stderr)
        return []
    return server_runs("llamacpp-f32", cmd, server_env(), model_dir.name, texts_by_c, max_tokens, workdir, 300)


# -- mixed cycles (prompts joining running batches) -------------------------------------------------


def varied_tokens(count: int, mean: int, seed: int = 1) -> list[int]:
    """Per-request output lengths, uniform in [mean/4, 7*mean/4] (seeded: the same for every run)."""
    import random

    rnd = random.Random(seed)
    return [rnd.randint(max(1, mean // 4), max(1, 7 * mean // 4)) for _ in range(count)]


def mixed_runs(model_dir: Path, workdir: Path, env: dict, cmd: list[str], concurrency: int, waves: int,
               max_tokens: int, rounds: int) -> list[dict]:
    """``kiln serve`` with ``--mixed-step-factor 0`` (no limit on a cycle's prompt tokens beside
    decoding rows) and with its default, interleaved ``rounds`` times; closed-loop clients whose
    requests have varied output lengths, so streams end out of step and every new prompt is
    prefilled beside running rows: ITL and TTFT of each setting."""
    texts = prompts_for(max(8, waves * concurrency))
    counts = varied_tokens(len(texts), max_tokens)
    out = []
    for r in range(rounds):
        for label, extra in (("factor-0", ["--mixed-step-factor", "0"]), ("default", [])):
            name = f"kiln-{label}"
            with running_server(name, cmd + extra, env, workdir, 300) as (base, proc):
                res = asyncio.run(http_load(base, model_dir.name, texts, counts, concurrency))
            res.update(system=name, round=r, itl_ratio=res["itl_p99_ms"] / res["itl_p50_ms"])
            print(f"  round {r} {name}: {res['tok_s']:.0f} tok/s, TTFT p50 {res['ttft_p50_ms']:.1f} p99 "
                  f"{res['ttft_p99_ms']:.1f} ms, ITL p50 {res['itl_p50_ms']:.2f} p99 {res['itl_p99_ms']:.2f} ms "
                  f"({res['itl_ratio']:.2f}x)", file=sys.stderr, flush=True)
            out.append(res)
    return out


# -- A/B of kiln serve settings ------------------------------------------------------------------------


def ab_runs(model_dir: Path, workdir: Path, arms: list[tuple[str, list[str], dict]], texts_by_c: dict,
            max_tokens: int, rounds: int) -> list[dict]:
    """Each arm (label, ``kiln serve`` command, environment) over every concurrency, interleaved
    ``rounds`` times with the order flipped every round (a noisy neighbour hits both alike):
    tokens/s, CPU per token, TTFT and ITL, and each round's TTFT p99 at c=8 / TTFT p50 at c=1 and
    ITL p99 / p50 at c=8."""
    out = []
    for r in range(rounds):
        for label, cmd, env in (arms if r % 2 == 0 else arms[::-1]):
            rows = server_runs(f"kiln-{label}", cmd, env, model_dir.name, texts_by_c, max_tokens, workdir, 300)
            by = {row["concurrency"]: row for row in rows}
            for row in rows:
                row.update(setting=label, round=r)
            if 1 in by and 8 in by:
                rows[-1]["ttft_ratio"] = by[8]["ttft_p99_ms"] / by[1]["ttft_p50_ms"]
                rows[-1]["itl_ratio"] = by[8]["itl_p99_ms"] / by[8]["itl_p50_ms"]
            out += rows
    return out


def revision_tree(rev: str, workdir: Path) -> Path:
    """A detached git worktree of ``rev`` under ``workdir`` (removed again at exit), whose ``src`` an
    A/B arm puts first on ``PYTHONPATH``: the same venv then runs that revision's Kiln."""
    import atexit

    tree = workdir / f"rev-{re.sub(r'[^A-Za-z0-9._-]', '_', rev)}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    atexit.register(subprocess.run, ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False)
    return tree


def revision_env(env: dict, tree: Path) -> dict:
    """``env`` with ``tree``'s Kiln first on the import path; checked, since an install that finds
    packages some other way would silently run this tree's code in both arms."""
    out = dict(env, PYTHONPATH=str(tree / "src"))
    found = subprocess.run([sys.executable, "-c", "import kiln; print(kiln.__file__)"], env=out, check=True,
                           capture_output=True, text=True).stdout.strip()
    if not Path(found).resolve().is_relative_to((tree / "src").resolve()):
        sys.exit(f"--ab-rev: kiln imports from {found}, not from {tree / 'src'}; install Kiln editable (pip -e)")
    return out


# -- structured output ----------------------------------------------------------------------------

# Open-ended on purpose (an array of short notes): with ignore_eos every request generates
# --max-tokens tokens, and the grammar stays live (not yet complete) for most of them.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 24},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
    "required": ["topic", "notes"], "additionalProperties": False}


def mask_cost(model_dir: Path, steps: int = 400, rows: int = 8) -> dict:
    """In process: the grammar's cost per token on one row computed in line (llguidance fill +
    apply), and the batched sampler's cost per step for ``rows`` greedy rows: none, one and all
    of them constrained. Between steps a matmul stands in for the model's forward (about the
    built-in model's step), so the masks prepared on the worker thread overlap it as in serving;
    the step cost counts only the sampler (its waits for the worker included)."""
    import torch
    from transformers import AutoTokenizer

    from kiln.runtime.constrained import GrammarCompiler
    from kiln.runtime.sampling import SamplingParams, select_tokens

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = max(int(cfg.get("vocab_size", 0)), len(tok))
    comp = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    grammar = comp.json_schema(STRUCTURED_SCHEMA, "bench")
    g = torch.Generator().manual_seed(0)
    forward_a, forward_b = torch.randn(256, 256), torch.randn(256, 256)

    class Row:
        def __init__(self):
            self.prompt, self.generated, self.eos_ids = [1], [], frozenset({tok.eos_token_id})

    def run(constrained: int) -> tuple[float, float, int]:
        hist = [Row() for _ in range(rows)]
        params = [SamplingParams(max_tokens=steps, temperature=0, constraint=comp.matcher(grammar))
                  if i < constrained else SamplingParams(max_tokens=steps, temperature=0) for i in range(rows)]
        total = masked = 0.0
        live = 0
        for _ in range(steps):
            for _ in range(4):  # the forward's stand-in
                forward_a @ forward_b
            logits = torch.randn(rows, vocab, generator=g) * 3
            logits[:, tok.eos_token_id] = -1e4  # keep going: the grammar stays live
            t0 = time.perf_counter()
            out = select_tokens(logits, params, [None] * rows, None, hist)
            dt = time.perf_counter() - t0
            total += dt
            for r, o in zip(hist, out):
                r.generated.append(o.token_id)
        if constrained:  # the mask alone, in line, replayed along the first row's own tokens
            c = comp.matcher(grammar)
            seq = hist[0].generated
            row = torch.zeros(1, vocab)
            done: list[int] = []
            for tok_id in seq:
                before = c.mask_calls
                t0 = time.perf_counter()
                c.apply(row, done)
                if c.mask_calls > before:  # the grammar was live (not yet complete): a real mask
                    masked += time.perf_counter() - t0
                done.append(tok_id)
            live = c.mask_calls
        return total / steps, masked / max(1, live), live

    plain = min(run(0)[0] for _ in range(3))
    one = min((run(1) for _ in range(3)), key=lambda r: r[0])
    every = min(run(rows)[0] for _ in range(3))
    return {"sampler_step_us_plain": 1e6 * plain, "sampler_step_us_one_constrained": 1e6 * one[0],
            "sampler_step_us_all_constrained": 1e6 * every,
            "sampler_us_per_constrained_token": 1e6 * (every - plain) / rows,
            "mask_us_per_token": 1e6 * one[1], "mask_live_tokens": one[2], "rows": rows, "vocab": vocab}


def structured_runs(model_dir: Path, workdir: Path, env: dict, kiln_cmd: list[str], concurrency: int,
                    max_tokens: int, rounds: int = 5) -> dict:
    """Interleaved A/B rounds on one server (a noisy neighbour hits both alike): best tokens/s of
    each, the median of the per-round ratios, and CPU time (server + client) per token."""
    fmt = {"response_format": {"type": "json_schema",
                               "json_schema": {"name": "notes", "schema": STRUCTURED_SCHEMA, "strict": True}}}
    texts = prompts_for(max(8, 4 * concurrency))
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    with running_server("kiln-structured", kiln_cmd, env, workdir, 300) as (base, proc):
        asyncio.run(http_load(base, model_dir.name, texts[:concurrency], 8, concurrency, fmt))  # warm-up
        for _ in range(rounds):
            for name, extra in (("unconstrained", None), ("json_schema", fmt)):
                s0, c0 = tree_cpu_s(proc.pid), time.process_time()
                r = asyncio.run(http_load(base, model_dir.name, texts, max_tokens, concurrency, extra))
                cpu = tree_cpu_s(proc.pid) - s0 + time.process_time() - c0
                r["cpu_ms_per_tok"] = 1000 * cpu / max(1, r["tokens"])
                runs[name].append(r)
                print(f"  {name} c={concurrency}: {r['tok_s']:.0f} tok/s, {r['cpu_ms_per_tok']:.3f} CPU ms/token",
                      file=sys.stderr, flush=True)
    best = {k: max(r["tok_s"] for r in v) for k, v in runs.items()}
    cpu = {k: min(r["cpu_ms_per_tok"] for r in v) for k, v in runs.items()}
    pairs = sorted(b["tok_s"] / a["tok_s"] for a, b in zip(runs["unconstrained"], runs["json_schema"]))
    return {"concurrency": concurrency, "rounds": rounds, "tok_s_unconstrained": best["unconstrained"],
            "tok_s_json_schema": best["json_schema"], "ratio": best["json_schema"] / best["unconstrained"],
            "ratio_median_of_rounds": pairs[len(pairs) // 2], "ratio_rounds": pairs,
            "cpu_ms_per_tok_unconstrained": cpu["unconstrained"], "cpu_ms_per_tok_json_schema": cpu["json_schema"],
            "cpu_ratio": cpu["unconstrained"] / cpu["json_schema"]}


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the built-in model, built if missing)")
    ap.add_argument("--shape", choices=sorted(SHAPES),
                    help="build and use a Qwen3 (or Qwen3.5 hybrid) shape with random weights")
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix-cache TTFT run")
    ap.add_argument("--structured-only", action="store_true",
                    help="only the structured-output run (JSON schema vs unconstrained, mask cost per token)")
    ap.add_argument("--structured-concurrency", type=int, default=8)
    ap.add_argument("--structured-rounds", type=int, default=5, help="interleaved A/B rounds of the structured run")
    ap.add_argument("--mixed-only", action="store_true",
                    help="only the mixed-cycle run: batching.mixed_step_factor 0 vs default, varied output lengths")
    ap.add_argument("--mixed-concurrency", type=int, default=8)
    ap.add_argument("--mixed-rounds", type=int, default=2, help="interleaved A/B rounds of the mixed-cycle run")
    ap.add_argument("--compiled", action="store_true", help="also the engine with its compiled decode step")
    ap.add_argument("--ab", metavar="FLAGS",
                    help="only kiln serve with its defaults vs with these extra flags (one quoted string), "
                         "interleaved --ab-rounds times over --concurrency")
    ap.add_argument("--ab-rev", metavar="REV",
                    help="A/B this working tree (default) against git revision REV (other), same flags")
    ap.add_argument("--ab-rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=4, help="requests per run = waves x concurrency (min 8)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for every system (0: torch default)")
    ap.add_argument("--hf-cb", action="store_true", help="also time transformers' generate_batch")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".vllm-venv"))
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when its venv exists")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's server, f32 GGUF (bench/peers)")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine runs")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    model_dir = resolve_model(args.model, args.shape)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    texts_by_c = {c: prompts_for(max(8, args.waves * c)) for c in args.concurrency}
    batch_sizes = [c for c in args.concurrency if c > 1]
    all_texts = prompts_for(max(len(t) for t in texts_by_c.values()))

    print(f"model {model_dir}, {args.max_tokens} tokens per request, threads {args.threads or 'default'}",
          file=sys.stderr)
    if args.structured_only:
        senv = kiln_env(workdir)
        scmd = kiln_command(model_dir, args.threads)
        cost = mask_cost(model_dir)
        run = structured_runs(model_dir, workdir, senv, scmd, args.structured_concurrency, args.max_tokens,
                              args.structured_rounds)
        print(f"mask cost: {cost['mask_us_per_token']:.1f} us/token in line ({cost['mask_live_tokens']} live tokens, "
              f"vocab {cost['vocab']}); sampler step, {cost['rows']} rows: {cost['sampler_step_us_plain']:.0f} us "
              f"plain, {cost['sampler_step_us_one_constrained']:.0f} us with one constrained row, "
              f"{cost['sampler_step_us_all_constrained']:.0f} us with all ({cost['sampler_us_per_constrained_token']:.1f}"
              f" us per constrained token)")
        print(f"structured output c={run['concurrency']}: {run['tok_s_json_schema']:.0f} tok/s with a JSON schema vs "
              f"{run['tok_s_unconstrained']:.0f} unconstrained: {run['ratio']:.2f}x best-of-{run['rounds']} "
              f"(median of rounds {run['ratio_median_of_rounds']:.2f}x; CPU per token "
              f"{run['cpu_ratio']:.2f}x; target >= 0.85x)")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "model": str(model_dir), "mask": cost,
                                                   "structured": run}, indent=2))
        return
    if args.mixed_only:
        runs = mixed_runs(model_dir, workdir, kiln_env(workdir), kiln_command(model_dir, args.threads),
                          args.mixed_concurrency, args.waves, args.max_tokens, args.mixed_rounds)
        print(f"{'system':<18}{'round':>6}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
              f"{'p99/p50':>9}  (ms)")
        for r in runs:
            print(f"{r['system']:<18}{r['round']:>6}{r['tok_s']:>8.0f}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
                  f"{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>9.2f}{r['itl_ratio']:>9.2f}")
        if args.json:
            out = {"args": vars(args), "model": str(model_dir), "rows": runs}
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
    if args.ab or args.ab_rev:
        env, cmd = kiln_env(workdir), kiln_command(model_dir, args.threads)
        if args.ab_rev:
            arms = [("default", cmd, env), ("other", cmd, revision_env(env, revision_tree(args.ab_rev, workdir)))]
            print(f"A/B: this working tree (default) vs revision {args.ab_rev} (other)")
        else:
            arms = [("default", cmd, env), ("other", cmd + args.ab.split(), env)]
            print(f"A/B: default vs {args.ab}")
        runs = ab_runs(model_dir, workdir, arms, texts_by_c, args.max_tokens, args.ab_rounds)
        print(f"{'setting':<9}{'round':>6}{'c':>4}{'tok/s':>8}{'CPU ms/tok':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'ITL p50':>9}{'ITL p99':>9}{'TTFT x':>8}{'ITL x':>7}  (ms)")
        for r in runs:
            ratios = (f"{r['ttft_ratio']:>8.2f}{r['itl_ratio']:>7.2f}" if "ttft_ratio" in r else "")
            print(f"{r['setting']:<9}{r['round']:>6}{r['concurrency']:>4}{r['tok_s']:>8.0f}{r['cpu_ms_per_tok']:>11.3f}"
                  f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>9.2f}"
                  f"{ratios}")
        for label in ("default", "other"):
            mine = [r for r in runs if r["setting"] == label]
            best = {c: max(r["tok_s"] for r in mine if r["concurrency"] == c) for c in args.concurrency}
            ratios = sorted(r["ttft_ratio"] for r in mine if "ttft_ratio" in r)
            print(f"  {label}: best tok/s " + ", ".join(f"c={c} {v:.0f}" for c, v in best.items())
                  + (f"; TTFT p99(c=8)/p50(c=1) per round {', '.join(f'{x:.2f}' for x in ratios)}" if ratios else ""))
        for c in args.concurrency:
            pairs = [(d, o) for d in runs for o in runs if d["setting"] == "default" and o["setting"] == "other"
                     and d["round"] == o["round"] and d["concurrency"] == o["concurrency"] == c]
            print(f"  c={c}: default / other tok/s per round " + ", ".join(f"{d['tok_s'] / o['tok_s']:.2f}"
                                                                        for d, o in pairs)
                  + "; CPU per token " + ", ".join(f"{d['cpu_ms_per_tok'] / o['cpu_ms_per_tok']:.2f}"
                                                   for d, o in pairs))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "model": str(model_dir), "rows": runs},
                                                  indent=2))
        return
    if args.prefix_only:
        rows = prefix_runs(model_dir)
        for r in rows:
            print(f"{r['system']:<16} prompt {r['prompt_tokens']} tokens, TTFT p50 {r['ttft_ms']:.1f} ms"
                  + (f", {r['ratio']:.2f}x cold ({r['hit_blocks']} cached blocks reused)" if "ratio" in r else ""))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "model": str(model_dir), "rows": rows}, indent=2))
        return
    rows = [] if args.no_hf else hf_runs(model_dir, all_texts, args.max_tokens, batch_sizes, 8, args.hf_cb)
    if not args.no_engine:
        rows += engine_runs(model_dir, texts_by_c, args.max_tokens, threads=args.threads)
        if args.compiled:
            rows += engine_runs(model_dir, texts_by_c, args.max_tokens, compiled=True, threads=args.threads)

    rows += server_runs("kiln", kiln_command(model_dir, args.threads), kiln_env(workdir), model_dir.name,
                        texts_by_c, args.max_tokens, workdir, 300)

    if args.llamacpp:
        rows += llamacpp_runs(model_dir, args.threads, texts_by_c, args.max_tokens, workdir)
    vpy = Path(args.vllm_venv) / "bin" / "python"
    if vpy.exists() and not args.no_vllm:
        try:
            rows += server_runs("vllm", vllm_command(vpy, model_dir), vllm_env(args.threads), model_dir.name,
                                texts_by_c, args.max_tokens, workdir, 600)
        except RuntimeError as exc:
            print(f"vLLM run failed: {exc}", file=sys.stderr)

    report(rows, args.concurrency)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "model": str(model_dir), "rows": rows}, indent=2))


def report(rows: list[dict], concurrency: list[int]) -> None:
    print(f"{'system':<16}{'tok/s':>9}{'CPU ms/tok':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}  (ms)")
    for r in rows:
        extra = "".join(f"{r[k]:>10.1f}" if k.startswith("ttft") else f"{r[k]:>9.2f}"
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms") if k in r)
        print(f"{r['system']:<16}{r['tok_s']:>9.0f}{r.get('cpu_ms_per_tok', float('nan')):>11.3f}{extra}")
    by = {r["system"]: r for r in rows}
    seq = by.get("hf-seq", {}).get("tok_s")
    print("\nratios")
    for c in concurrency:
        k = by.get(f"kiln-c{c}")
        if k is None:
            continue
        parts = [f"kiln-c{c}"]
        if seq:
            parts.append(f"{k['tok_s'] / seq:.2f}x hf-seq")
        if f"hf-static-{c}" in by:
            st = by[f"hf-static-{c}"]
            parts.append(f"{k['tok_s'] / st['tok_s']:.2f}x hf-static-{c}")
            parts.append(f"CPU/token {k['cpu_ms_per_tok'] / st['cpu_ms_per_tok']:.2f}x hf-static-{c}'s")
            if f"engine-c{c}" in by:
                parts.append(f"engine alone {by[f'engine-c{c}']['tok_s'] / st['tok_s']:.2f}x hf-static-{c}")
        for peer in ("vllm", "llamacpp-f32"):
            if f"{peer}-c{c}" in by:
                parts.append(f"{k['tok_s'] / by[f'{peer}-c{c}']['tok_s']:.2f}x {peer}-c{c}")
        print("  " + ", ".join(parts))
    for name in ("kiln", "vllm", "llamacpp-f32"):
        s1, s8 = by.get(f"{name}-c1"), by.get(f"{name}-c8")
        if s1 and s8:
            print(f"  {name} TTFT p99 at c=8 / TTFT p50 at c=1: {s8['ttft_p99_ms'] / s1['ttft_p50_ms']:.2f} (target <= 3); "
                  f"ITL p99 / ITL p50 at c=8: {s8['itl_p99_ms'] / s8['itl_p50_ms']:.2f} (target <= 2)")
    if "hf-cb" in by and seq:
        print(f"  hf-cb (generate_batch, all prompts at once): {by['hf-cb']['tok_s'] / seq:.2f}x hf-seq")


if __name__ == "__main__":
    main()
