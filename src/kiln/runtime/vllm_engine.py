"""``[serving] engine = "vllm"``: the engine facade the routes use, fulfilled by a vLLM subprocess.

:class:`VllmEngine` offers what :class:`kiln.runtime.engine.Engine` offers the rest of
Kiln (``submit`` with the same :class:`~kiln.runtime.submission.Submission` and
:class:`~kiln.runtime.submission.RowStream` objects, ``score_prompt``, ``generate``,
adapter activation, tokenization, ``health``/``stats``), so Kiln's routes, validation,
errors, auth, headers, training, evals and teachers run unchanged in front of it.
Kiln still renders and tokenizes (its tokenizer, its chat template, its stop strings);
vLLM receives token IDs on its private loopback ``/v1/completions`` and streams token
IDs back (``return_token_ids``, logprobs keyed ``token_id:N``), which Kiln detokenizes
with the same :class:`~kiln.runtime.textstream.TextStream` the built-in engine uses.

One HTTP pump thread (an asyncio loop with one ``httpx.AsyncClient``) carries every
request; cancelling a submission cancels its task, which closes the stream, and vLLM
aborts the request when its client goes away.

LoRA: an adapter revision is loaded into vLLM under its own name,
``<adapter>@<revision[:12]>`` (the same key the built-in engine uses), through
``/v1/load_lora_adapter`` and canary-checked with a short greedy completion.
:class:`LoraTable` maps each served name to its current key and counts the rows
using each key: a hot swap loads a new key and flips the mapping, rows already sent
finish on the old key, and a key no name maps to is unloaded when its last row ends.

Training: the trainer keeps working on Kiln's own copy of the base model (loaded in
this process for tokenization and training: two copies of the base weights in all,
one here and one in vLLM); ``peft_model``/``delete_private_adapter`` act on that copy,
and activation of a published adapter is a vLLM LoRA load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from kiln.adapter_names import MAX_ADAPTER_NAME_CHARS, is_valid_name  # the one adapter-name rule
from kiln.errors import InvalidRequest
from kiln.runtime.adapter_refs import AdapterRefs
from kiln.runtime.adapter_slots import (
    AdapterError,
    AdapterSlots,
    UnknownAdapter,
    adapter_key,
)
from kiln.runtime.engine import Engine
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.serving_engine import TokenFacade
from kiln.runtime.sampling import SamplingParams, TokenChoice
from kiln.runtime.scoring import PromptLogprobRow, ScoredToken
from kiln.runtime.submission import (
    Admission,
    EngineError,
    EngineNotRunning,
    EngineOverloaded,
    Observer,
    PromptTooLong,
    RowStream,
    Submission,
)
from kiln.runtime.textstream import TextStream
from kiln.runtime.tokenization import Tokenization

log = logging.getLogger("kiln.vllm")

CANARY_TOKENS = 4
CONTROL_TIMEOUT_S = 120.0  # a LoRA load/unload or canary; a load reads the adapter from disk
TOKEN_ID_PREFIX = "token_id:"


class UnsupportedOnVllm(InvalidRequest):
    """A request feature the vLLM engine mode does not forward."""

    code = "unsupported_on_vllm_engine"
    default_hint = "send the request without it, or serve with [serving] engine = \"builtin\""


# ------------------------------------------------------------------ LoRA names


class LoraTable:
    """Served adapter name -> vLLM LoRA name (one per revision), with in-flight references.

    The built-in engine's table (:class:`~kiln.runtime.adapter_refs.AdapterRefs`), with each key
    leaving it as soon as it may go: ``activate``, ``deactivate`` and ``release`` return the key
    the caller must unload from vLLM now (no row holds it any more), else ``None``.
    """

    def __init__(self) -> None:
        self._refs = AdapterRefs()

    def current(self, name: str) -> str | None:
        return self._refs.current(name)

    def acquire(self, name: str) -> tuple[str, str]:
        return self._refs.acquire(name)

    def active(self) -> dict[str, str]:
        return self._refs.active()

    def loaded_keys(self) -> set[str]:
        """Keys vLLM must still hold: served ones and retired ones still in use."""
        return self._refs.live_keys()

    def activate(self, name: str, key: str, revision: str) -> str | None:
        return self._unload(self._refs.activate(name, key, revision))

    def deactivate(self, name: str) -> str | None:
        return self._unload(self._refs.deactivate(name))

    def release(self, key: str) -> str | None:
        return self._unload(key if self._refs.release(key) else None)

    def _unload(self, key: str | None) -> str | None:
        if key is not None:
            self._refs.forget(key)
        return key


# ------------------------------------------------------------------ wire mapping


def completion_body(model: str, prompt_ids: list[int], p: SamplingParams) -> dict[str, Any]:
    """vLLM ``/v1/completions`` body for one row; Kiln-only features are refused first."""
    if p.constraint is not None:
        from kiln.runtime.thinking import ThinkingBudget  # only with a constraint (a grammar imports torch too)

        if isinstance(p.constraint, ThinkingBudget):
            raise UnsupportedOnVllm("thinking budgets are not forwarded to the vLLM engine",
                                    param="thinking_token_budget")
        raise UnsupportedOnVllm("structured output (response_format, tool_choice, guided_*) is not forwarded to "
                                "the vLLM engine", param="response_format")
    if p.bad_words:
        raise UnsupportedOnVllm("bad_words is not forwarded to the vLLM engine", param="bad_words")
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": p.max_tokens, "n": 1, "stream": True,
        "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
        "return_token_ids": True, "skip_special_tokens": True, "ignore_eos": p.ignore_eos,
    }
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    if p.logprobs is not None:
        body["logprobs"] = p.logprobs
        body["return_tokens_as_token_ids"] = True
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0), ("min_tokens", 0)):
        if getattr(p, name) != default:
            body[name] = getattr(p, name)
    if p.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    if p.stop_token_ids:
        body["stop_token_ids"] = sorted(p.stop_token_ids)
    return body


def _token_id(label: str) -> int:
    if not label.startswith(TOKEN_ID_PREFIX):
        raise EngineError(f"vLLM returned logprob label {label[:40]!r} without return_tokens_as_token_ids")
    return int(label[len(TOKEN_ID_PREFIX):])


def token_choices(token_ids: list[int], logprobs: dict | None, k: int | None) -> list[TokenChoice]:
    """Kiln's per-token choices from one streamed vLLM chunk (top ``k`` best first, as the built-in engine)."""
    if logprobs is None or k is None:
        return [TokenChoice(t) for t in token_ids]
    out = []
    for i, t in enumerate(token_ids):
        lp = logprobs["token_logprobs"][i]
        tops = sorted(((_token_id(s), v) for s, v in (logprobs["top_logprobs"][i] or {}).items()),
                      key=lambda e: -e[1])
        out.append(TokenChoice(t, lp, tops[:k]))
    return out


def prompt_rows(prompt_ids: list[int], wire: list[dict | None]) -> list[PromptLogprobRow | None]:
    """vLLM ``prompt_logprobs`` (``{id: {logprob, rank}}`` per position) -> Kiln rows: the actual token first,
    then the others best first, each token once (see :mod:`kiln.runtime.scoring`)."""
    rows: list[PromptLogprobRow | None] = []
    for pos, entry in enumerate(wire):
        if entry is None:
            rows.append(None)
            continue
        actual = prompt_ids[pos]
        scored = {int(t): ScoredToken(int(t), float(e["logprob"]), int(e["rank"])) for t, e in entry.items()}
        first = scored.pop(actual)
        rows.append([first, *sorted(scored.values(), key=lambda s: (s.rank, s.token_id))])
    return rows


# ------------------------------------------------------------------ the facade


class _Canceller:
    """What :meth:`Submission.cancel` calls: cancels the rows' HTTP tasks."""

    def cancel(self, rows: list[Any]) -> None:
        for r in rows:
            r.cancel()


class _Row:
    __slots__ = ("cancelled", "counted", "generated", "key", "params", "released", "stream", "t_last", "task", "text")

    def __init__(self, stream: RowStream, params: SamplingParams, key: str | None, text: TextStream):
        self.stream, self.params, self.key, self.text = stream, params, key, text
        self.generated: list[int] = []
        self.task: Future | None = None
        self.cancelled = False
        self.released = False
        self.t_last = 0.0  # submission, then the last token's arrival (metrics)
        self.counted = 0  # tokens already reported to the observer

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()


class VllmEngine(TokenFacade):
    """The engine facade over a vLLM subprocess (see the module docstring)."""

    backend = "vllm"

    on_adapters_changed: Callable[[dict[str, str]], None] | None = None  # set by the composition root

    def __init__(self, loaded: Any, config: Any, plan: Any, *, observer: Observer | None = None,
                 ownership: AcceleratorOwnership | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokens = Tokenization(loaded.tokenizer, loaded.model)
        self.config = config
        self.plan = plan
        self.device = loaded.device
        self.observer = observer or Observer()
        self.ownership = ownership or AcceleratorOwnership()
        self.trainer_slots = AdapterSlots(self.model, self.ownership)  # the trainer's copy (PEFT, private adapters)
        self.loras = LoraTable()
        self.process: Any = None
        self.incarnation: str | None = None
        self.rank_decision: Any = None
        self.observation: Any = None
        self._state = "stopped"  # stopped | starting | ready | refused | failed
        self._why: str | None = "not started"
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._inflight = 0
        self._completed = 0
        self._ready_s: float | None = None

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> VllmEngine:
        """Spawn vLLM and return; readiness (and the rank-law check) completes in the background."""
        from kiln.runtime.vllm_process import VllmProcess

        self._stop.clear()
        self.tokens.warm()
        self.process = VllmProcess(self.plan)
        self.incarnation = self.process.token
        self._state, self._why = "starting", "vLLM is starting"
        self._thread = threading.Thread(target=self._run, name="kiln-vllm-pump", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self.process.start()
            self._why = f"vLLM is starting (pid {self.process.pid}, log {self.process.log_path})"
            self.process.wait_ready(self._stop)
            self._check_world()
        except Exception as exc:  # noqa: BLE001 - reported through health()
            log.error("vLLM engine failed to start: %s", exc)
            self._state, self._why = "failed", f"vLLM failed to start: {exc}"
            loop.close()
            return
        import httpx

        self._client = httpx.AsyncClient(
            base_url=self.process.base_url, headers={"Authorization": f"Bearer {self.process.api_key}"},
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=None,
                                                                            max_keepalive_connections=64),
            trust_env=False)
        if self._state == "starting":
            self._ready_s = time.monotonic() - self.process.started_at
            self._state, self._why = "ready", None
            log.info("vLLM engine ready in %.1f s on %s", self._ready_s, self.process.base_url)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._client.aclose())
            loop.close()

    def _check_world(self) -> None:
        """Acquire the world vLLM formed (its workers' rank reports) and decide it with the rank law."""
        from kiln.runtime.vllm_process import decide_world

        assert self.incarnation is not None, "the world is checked after the child has started"
        self.observation, self.rank_decision = decide_world(self.plan, self.process.log_lines(), self.incarnation,
                                                            complete=True)
        if not self.rank_decision.coherent:
            findings = json.dumps(self.rank_decision.to_json_dict()["findings"])
            self._state, self._why = "refused", f"the rank-population law refused the vLLM world: {findings}"
            log.error("%s", self._why)

    def stop(self, timeout_s: float = 30.0) -> bool:
        self._stop.set()
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass
        if thread is not None:
            thread.join(timeout_s)
        ok = thread is None or not thread.is_alive()
        if self.process is not None:
            try:
                self.process.stop()
            except Exception as exc:  # noqa: BLE001
                log.error("stopping vLLM: %s", exc)
                ok = False
        self._state, self._why = "stopped", "stopped"
        return ok

    @property
    def running(self) -> bool:
        return self._state == "ready" and self.process is not None and self.process.exit_code() is None

    @property
    def steps(self) -> int:
        return self._completed

    @property
    def max_request_rows(self) -> int:
        """The most rows one request may have in flight (see :meth:`_admit`)."""
        return self.config.max_running_rows + self.config.max_queued_rows

    def stats(self) -> dict[str, Any]:
        return {"queued_rows": 0, "active_rows": self._inflight, "max_running_rows": self.config.max_running_rows,
                "steps": self._completed, "failed": None if self._state in ("ready", "starting") else self._why,
                "kv_cache_bytes": self.plan.kv_cache_gib << 30,  # vLLM's KV space (in the child)
                "backend": "vllm", "vllm_state": self._state, "vllm_ready_s": self._ready_s}

    def health(self) -> tuple[bool, str | None]:
        if self._state == "ready" and self.process is not None and self.process.exit_code() is not None:
            self._state = "failed"
            self._why = f"vLLM exited with status {self.process.exit_code()} (log {self.process.log_path})"
        return self._state == "ready", self._why

    def describe(self) -> dict[str, Any]:
        """The vLLM side for ``/health``: state, pid, snapshot digest, fingerprint, rank decision."""
        p = self.process
        return {
            "state": self._state, "pid": None if p is None else p.pid,
            "snapshot_sha256": None if p is None else p.snapshot_digest,
            "fingerprint": None if p is None else p.fingerprint,
            "tensor_parallel_size": self.plan.tensor_parallel_size,
            "pipeline_parallel_size": self.plan.pipeline_parallel_size,
            "rank_population": None if self.rank_decision is None else self.rank_decision.to_json_dict(),
            "lora_keys": sorted(self.loras.loaded_keys()),
        }

    def _check_running(self) -> None:
        if not self.running:
            _ok, why = self.health()
            raise EngineNotRunning(f"the vLLM engine is not serving ({why}); see GET /health")

    # -- HTTP on the pump loop ------------------------------------------------------
    def _on_loop(self, coro) -> Future:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = await self._client.post(path, json=body)
        if r.status_code >= 400:
            raise EngineError(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def _control(self, path: str, body: dict[str, Any]) -> Any:
        self._check_running()
        return self._on_loop(self._post(path, body)).result(CONTROL_TIMEOUT_S)

    # -- adapters ---------------------------------------------------------------------
    def activate_adapter(self, name: str, path: Path, revision: str) -> None:
        """Load ``path`` into vLLM as ``name@revision[:12]``, canary it, then serve ``name`` from it."""
        if not is_valid_name(name):
            raise AdapterError(f"invalid adapter name {name[:80]!r}: 1-{MAX_ADAPTER_NAME_CHARS} of A-Z a-z 0-9 . _ -")
        if not self.plan.max_loras:
            raise AdapterError(f"cannot serve adapter {name!r}: vLLM runs without LoRA ([vllm] max_loras = 0)",
                               hint="set [vllm] max_loras to 1 or more and restart to serve adapters")
        key = adapter_key(name, revision)
        if self.loras.current(name) == key:
            return
        try:
            if key not in self.loras.loaded_keys():
                self._control("/v1/load_lora_adapter", {"lora_name": key, "lora_path": str(path)})
            self._canary(key)
        except (EngineError, TimeoutError) as exc:
            self._unload_quietly(key)
            raise AdapterError(f"cannot activate adapter {name!r} revision {revision[:12]} in vLLM from {path}: "
                               f"{exc}; the previous revision (if any) stays active") from exc
        stale = self.loras.activate(name, key, revision)
        if stale is not None:
            self._unload_quietly(stale)
        self._adapters_changed()

    def _canary(self, key: str) -> None:
        ids = self.encode_chat([{"role": "user", "content": "Hello"}])
        out = self._control("/v1/completions", {"model": key, "prompt": ids, "max_tokens": CANARY_TOKENS,
                                                "temperature": 0.0, "logprobs": 0})
        lps = out["choices"][0]["logprobs"]["token_logprobs"]
        if not all(lp is not None and math.isfinite(lp) for lp in lps):
            raise EngineError(f"canary generation produced non-finite logprobs {lps}")

    def _unload_quietly(self, key: str) -> None:
        try:
            self._control("/v1/unload_lora_adapter", {"lora_name": key})
        except Exception as exc:  # noqa: BLE001 - a key vLLM never loaded, or a stopped engine
            log.info("unloading LoRA %s from vLLM: %s", key, exc)

    def deactivate_adapter(self, name: str) -> None:
        stale = self.loras.deactivate(name)
        if stale is not None:
            self._unload_quietly(stale)
        self._adapters_changed()

    def _adapters_changed(self) -> None:
        """Tell ``on_adapters_changed`` (the served-set recorder, set by the composition root) the new set."""
        if self.on_adapters_changed is not None:
            self.on_adapters_changed(self.active_adapters())

    def active_adapters(self) -> dict[str, str]:
        return self.loras.active()

    def peft_model(self) -> Any:
        return self.trainer_slots.peft_model()

    def delete_private_adapter(self, private_name: str) -> None:
        self.trainer_slots.delete_private(private_name)

    # -- blocking generation: the built-in engine's own method (it uses only ``self.submit``), so
    # both engines collect alike; tokenization comes from TokenFacade
    generate = Engine.generate

    # -- admission -----------------------------------------------------------------
    def _admit(self, rows: int) -> None:
        with self._lock:
            if self._inflight + rows > self.config.max_running_rows + self.config.max_queued_rows:
                raise EngineOverloaded(
                    f"{self._inflight} rows are already in flight to vLLM (limit batching.max_running_rows + "
                    f"batching.max_queued_rows = {self.config.max_running_rows + self.config.max_queued_rows}); "
                    "retry later")
            self._inflight += rows

    def _done(self, row: _Row | None = None) -> None:
        with self._lock:
            self._inflight -= 1
            self._completed += 1
        if row is not None and row.key is not None and not row.released:
            row.released = True
            stale = self.loras.release(row.key)
            if stale is not None:
                self._on_loop(self._post("/v1/unload_lora_adapter", {"lora_name": stale}))

    def _model_for(self, adapter: str | None) -> tuple[str | None, str | None]:
        if adapter is None:
            return None, None
        return self.loras.acquire(adapter)

    def _check_len(self, prompt_ids: list[int], extra: int) -> None:
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty; send at least one token")
        limit = self.config.max_model_len
        if len(prompt_ids) + extra > limit or (extra and len(prompt_ids) >= limit):
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({extra}) exceeds the model "
                                f"length limit of {limit} tokens; shorten the prompt or lower max_tokens")

    def admission(self) -> Admission:
        """A no-op: vLLM schedules its own arrivals (the in-process engine gathers bursts with it)."""
        return Admission()

    def submit(self, prompt_ids: list[int], params: list[SamplingParams], *, adapter: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None, incremental: bool = True,
               private_revision: str | None = None) -> Submission:
        """Queue one row per entry of ``params`` (each its own vLLM request with ``n=1``). A trainer's
        private adapter (``private_revision``) lives in this process, not in vLLM: refused."""
        if private_revision is not None:
            raise UnsupportedOnVllm("sampling from a trainer's private adapter runs on the built-in engine, not "
                                    "through vLLM")
        self._check_running()
        self._check_len(prompt_ids, max(p.max_tokens for p in params))
        bodies = [completion_body("", prompt_ids, p) for p in params]  # refusals before anything is held
        self._admit(len(params))
        keys: list[str | None] = []
        revision = None
        try:
            for _ in params:
                key, revision = self._model_for(adapter)
                keys.append(key)
        except UnknownAdapter:
            for k in keys:
                if k is not None:
                    self.loras.release(k)
            with self._lock:
                self._inflight -= len(params)
            raise
        shared_event = asyncio.Event() if loop is not None else None
        streams = [RowStream(i, loop, shared_event, incremental) for i in range(len(params))]
        rows = []
        for s, p, k, body in zip(streams, params, keys, bodies):
            s.prompt_tokens = len(prompt_ids)
            body["model"] = k or self.plan.served_model_id
            row = _Row(s, p, k, TextStream(self.tokenizer, p.stop))
            row.task = self._on_loop(self._stream_row(row, body))
            rows.append(row)
        return Submission(streams, adapter, revision, len(prompt_ids), rows, _Canceller())  # type: ignore[arg-type]

    def _wake(self, stream: RowStream) -> None:
        if stream.loop is None:
            stream._wake()
            return
        try:
            stream.loop.call_soon_threadsafe(stream._wake)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _feed(self, row: _Row, choice: dict[str, Any]) -> str | None:
        """Push one vLLM choice's tokens into the row (as the built-in engine's sampler does); the finish
        reason once the row ends (end token, stop string, stop token, length), else ``None``."""
        p, obs, eos = row.params, self.observer, self.tokens.eos_ids
        reason = None
        for tc in token_choices(choice.get("token_ids") or [], choice.get("logprobs"), p.logprobs):
            now = time.perf_counter()
            obs.inter_token(now - row.t_last) if row.generated else obs.first_token(now - row.t_last)
            row.t_last = now
            row.generated.append(tc.token_id)
            text = ""
            if (tc.token_id in eos and not p.ignore_eos) or tc.token_id in p.stop_token_ids:
                reason = "stop"
            else:
                text = row.text.push(tc.token_id)
                if row.text.stopped:
                    reason = "stop"
            row.stream._push(text, tc)
            if reason is None and len(row.generated) >= p.max_tokens:
                reason = "length"
            if reason is not None:
                break
        obs.tokens_generated(len(row.generated) - row.counted)
        row.counted = len(row.generated)
        if reason is None and choice.get("finish_reason"):
            reason = "length" if choice["finish_reason"] == "length" else "stop"
        return reason

    async def _stream_row(self, row: _Row, body: dict[str, Any]) -> None:
        """One row: streamed from vLLM when its consumer reads incrementally, else one plain response."""
        stream = row.stream
        reason: str | None = None
        row.t_last = time.perf_counter()
        try:
            if not stream.incremental:
                out = await self._post("/v1/completions", body | {"stream": False})
                reason = self._feed(row, out["choices"][0]) or "stop"
            else:
                async with self._client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code >= 400:
                        text = (await r.aread()).decode(errors="replace")
                        raise EngineError(f"vLLM /v1/completions answered {r.status_code}: {text[:500]}")
                    reason = await self._read_events(r, row)
        except asyncio.CancelledError:
            reason = "abort"
        except Exception as exc:  # noqa: BLE001 - one failed row ends as `error`, the engine keeps serving
            log.error("vLLM row failed: %s", exc)
            reason = "error"
        finally:
            stream.completion_tokens = len(row.generated)
            stream._push(row.text.flush(), None)
            stream._close(reason or "abort")
            self._wake(stream)
            self._done(row)

    async def _read_events(self, r: Any, row: _Row) -> str:
        """Server-sent events from raw bytes (one ``data: {...}`` per event): every event read in one
        network read is fed before the consumer is woken once."""
        buf = b""
        async for raw in r.aiter_raw():
            buf += raw
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    raise EngineError(f"vLLM stream error: {chunk['error']}")
                reason = self._feed(row, chunk["choices"][0])
                if reason is not None:
                    return reason
            self._wake(row.stream)
        return "abort"

    def score_prompt(self, prompt_ids: list[int], top_k: int, *, adapter: str | None = None) -> Future:
        """Future of per-position prompt logprob rows (first ``None``) from vLLM's ``prompt_logprobs``."""
        self._check_running()
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty; send at least one token")
        if len(prompt_ids) > self.config.max_model_len - 1:
            raise PromptTooLong(f"prompt has {len(prompt_ids)} tokens; vLLM scores at most "
                                f"{self.config.max_model_len - 1} (one position is kept for the sampled token)")
        self._admit(1)
        try:
            key, _ = self._model_for(adapter)
        except UnknownAdapter:
            with self._lock:
                self._inflight -= 1
            raise
        body = {"model": key or self.plan.served_model_id, "prompt": list(prompt_ids), "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": top_k}
        row = _Row(RowStream(0, None), SamplingParams(max_tokens=1), key, TextStream(self.tokenizer))

        async def run() -> list[PromptLogprobRow | None]:
            try:
                out = await self._post("/v1/completions", body)
                return prompt_rows(list(prompt_ids), out["choices"][0]["prompt_logprobs"])
            finally:
                self._done(row)

        return self._on_loop(run())
