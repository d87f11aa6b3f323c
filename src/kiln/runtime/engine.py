"""The batching engine's facade: what the rest of Kiln calls.

:class:`Engine` wires the parts together and owns the public API; each part
lives in its own module:

* :mod:`kiln.runtime.submission` - the consumer side (``Submission``, ``RowStream``,
  ``Completion``) and the errors a caller sees;
* :mod:`kiln.runtime.scheduler` - the actor thread, the inbox, one cycle (schedule -> execute -> update), health;
* :mod:`kiln.runtime.cycle_plan`, :mod:`kiln.runtime.cycle_execute`, :mod:`kiln.runtime.cycle_update` - the
  three steps of a cycle; :mod:`kiln.runtime.cycle_faults` - its failure classes and containment;
* :mod:`kiln.runtime.row_queues` - rows by stage, admission by memory, preemption;
* :mod:`kiln.runtime.paged_kv` - the paged KV pool; :mod:`kiln.runtime.kv_ledger` - each row's blocks,
  prefix publication and state slot;
* :mod:`kiln.runtime.batches` - the packed, decode and prefill forwards;
* :mod:`kiln.runtime.tokenization` - chat rendering, tokenizing, token text;
* :mod:`kiln.runtime.adapter_slots` - live LoRA adapters (name -> key, references).

Generation (:meth:`Engine.submit`) and scoring (:meth:`Engine.score_prompt`) go
through the same queue (``batching.max_queued_rows``: :class:`EngineOverloaded`
when full) and the same per-cycle token budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.config import ConfigError
from kiln.runtime.adapter_slots import BASE_KEY, AdapterError, AdapterSlots, UnknownAdapter
from kiln.runtime.batches import PACKED_MAX_SCORES, Batches
from kiln.runtime import paged_attention, request_trace
from kiln.runtime.linear_state import SNAPSHOTS_PER_SLOT, LinearStatePool, linear_layers
from kiln.runtime.loader import ModelLoadError
from kiln.runtime.memory import memory_total_bytes
from kiln.runtime.paged_kv import BlockPool, CacheShape, block_bytes, cache_shape
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.sampling import SamplingParams, make_generator
from kiln.runtime.serving_engine import TokenFacade
from kiln.runtime.engine_config import EngineConfig
from kiln.runtime.rows import Row, ScoreRow
from kiln.runtime.scheduler import JOIN_TIMEOUT_S, Scheduler
from kiln.runtime.submission import (
    Admission,
    Completion,
    EngineError,
    EngineNotRunning,
    EngineOverloaded,
    Observer,
    PromptTooLong,
    RowStream,
    StreamChunk,
    Submission,
)
from kiln.runtime.textstream import TextStream
from kiln.runtime.tokenization import Tokenization

log = logging.getLogger(__name__)

CANARY_TOKENS = 4
CANARY_MESSAGE = "Hello"
MAX_KV_BUDGET_FRACTION = 0.9  # of RAM or device memory: the weights and activations need the rest

__all__ = [
    "AdapterError",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineNotRunning",
    "Observer",
    "PACKED_MAX_SCORES",
    "PromptTooLong",
    "RowStream",
    "StreamChunk",
    "Submission",
    "UnknownAdapter",
]


def prompt_macs_per_token(model: Any) -> int:
    """Multiply-adds a prompt token costs: the model's weights less its embedding tables (a
    prompt token reads one embedding row, and only a row's last token reaches the LM head)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    tables = [getattr(model, name, lambda: None)() for name in ("get_input_embeddings", "get_output_embeddings")]
    for emb in tables:
        weight = getattr(emb, "weight", None)
        if weight is not None and weight.data_ptr() in seen:
            seen.discard(weight.data_ptr())
            total -= weight.numel()
    return max(0, total)


def kv_pool_blocks(cfg: EngineConfig, shape: CacheShape, dtype: torch.dtype, device: Any = "cpu",
                   reserved_bytes: int = 0) -> int:
    """Blocks in the KV pool (the scratch block included): ``kv_budget_bytes`` worth, or
    ``kv_budget_fraction`` of the memory (RAM, or the CUDA device's), less ``reserved_bytes`` (a
    hybrid's linear-state slots), or by default enough for ``max_running_rows`` rows of
    ``max_model_len`` (on CPU only touched blocks take memory).
    A budget too small for one block is a :class:`ConfigError` naming its key."""
    per_block = block_bytes(shape, cfg.kv_block_size, dtype)
    if cfg.kv_budget_bytes and cfg.kv_budget_fraction:
        raise ConfigError("set batching.kv_budget_bytes or batching.kv_budget_fraction, not both")
    if cfg.kv_budget_fraction:
        if not 0.0 < cfg.kv_budget_fraction <= MAX_KV_BUDGET_FRACTION:
            raise ConfigError(f"batching.kv_budget_fraction must be in (0, {MAX_KV_BUDGET_FRACTION}], "
                              f"got {cfg.kv_budget_fraction}")
        budget, key = int(cfg.kv_budget_fraction * memory_total_bytes(device)), "batching.kv_budget_fraction"
    elif cfg.kv_budget_bytes:
        budget, key = cfg.kv_budget_bytes, "batching.kv_budget_bytes"
    else:
        return cfg.max_running_rows * -(-cfg.max_model_len // cfg.kv_block_size) + 1
    budget -= reserved_bytes
    if budget < per_block:
        raise ConfigError(f"{key} gives a KV budget of {budget} bytes (after {reserved_bytes} bytes of "
                          f"linear-attention state), less than one KV block of {cfg.kv_block_size} tokens "
                          f"({per_block} bytes for this model); raise it")
    return budget // per_block + 1


def _pool_blocks(cfg: EngineConfig, shape: CacheShape, dtype: torch.dtype, device: Any,
                 states: LinearStatePool | None) -> tuple[int, bool]:
    """(KV pool blocks, prefix cache on): a hybrid's linear-state slots come out of the KV budget, and
    with the prefix cache its state snapshots too (kiln.runtime.linear_state); a budget that holds the
    slots but not the snapshots keeps the pool and turns the hybrid's prefix cache off (logged)."""
    if states is None:
        return kv_pool_blocks(cfg, shape, dtype, device), cfg.prefix_cache
    if cfg.prefix_cache:
        try:
            return kv_pool_blocks(cfg, shape, dtype, device, states.nbytes() * (1 + SNAPSHOTS_PER_SLOT)), True
        except ConfigError:
            log.warning("the KV budget cannot also hold the hybrid prefix cache's state snapshots "
                        "(%d bytes); the prefix cache is off", states.nbytes() * SNAPSHOTS_PER_SLOT)
    return kv_pool_blocks(cfg, shape, dtype, device, states.nbytes()), False


class _ProbeRow:
    """The fields the batch builders read of a row (kiln.runtime.batches), for :meth:`Engine._probe`."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.blocks: list[int] = []
        self.prefilled = self.pos = 0
        self.generated: list[int] = []
        self.adapter_key = BASE_KEY
        self.state_slot: int | None = -1


class Engine(TokenFacade):
    """Continuous-batching engine over one loaded model (see the module docstring)."""

    on_adapters_changed: Callable[[dict[str, str]], None] | None = None  # set by the composition root

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig | None = None,
        *,
        ownership: AcceleratorOwnership | None = None,
        observer: Observer | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokens = Tokenization(loaded.tokenizer, loaded.model)
        self.config = config or EngineConfig()
        self.ownership = ownership or AcceleratorOwnership()
        self.observer = observer or Observer()
        self.adapters = AdapterSlots(self.model, self.ownership)
        self.device = loaded.device
        dtype = next(self.model.parameters()).dtype
        cfg = self.config
        shape = cache_shape(self.model.config)
        linear = linear_layers(self.model)
        # a hybrid's rows each hold a linear-state slot (kiln.runtime.linear_state); its prefix cache needs the
        # state at the prefix end too: snapshots the lean hybrid forward takes (else the cache is off)
        states = LinearStatePool(linear, cfg.max_running_rows, device=self.device, dtype=dtype) if linear else None
        self.states = states
        blocks, prefix_cache = _pool_blocks(cfg, shape, dtype, self.device, states)
        kv = BlockPool(shape, blocks, cfg.kv_block_size, device=self.device, dtype=dtype, prefix_cache=prefix_cache)
        self._kv = kv
        batches = Batches(kv, self.adapters, self.device, self.tokens.pad_id, compile_decode=cfg.compile_decode,
                          max_rows=cfg.max_running_rows, max_blocks=kv.blocks_for(cfg.max_model_len),
                          model=self.model, lean=cfg.lean_forward, packed_weights=cfg.packed_weights,
                          paged_attention=self._paged_attention(dtype), states=states)
        kernels = getattr(loaded, "linear_kernels", None)  # a hybrid's Gated DeltaNet route (/health linear_state.kernels)
        self.linear_kernels = kernels.describe(lean=batches.hybrid is not None) if kernels is not None else None
        if self.linear_kernels is not None:
            log.info("hybrid Gated DeltaNet kernels: %s", self.linear_kernels)
        if states is not None and batches.snapshots is None:  # no state snapshots (transformers' path): no cache
            kv.prefix_cache = False
        self._probe(batches)
        self._scheduler = Scheduler(cfg, kv, batches, self.adapters, self.ownership, self.observer, self.device,
                                    macs_per_token=prompt_macs_per_token(self.model), prompt_text=self.tokens.decode)

    @property
    def max_request_rows(self) -> int:
        """The most rows one request may submit: its rows are queued at once, so more than
        ``batching.max_queued_rows`` could never be admitted (a 400, not a 429 forever)."""
        return self.config.max_queued_rows

    @property
    def prefix_cache(self) -> dict[str, bool]:
        """``batching.prefix_cache`` as configured, and whether the engine uses it (a hybrid: only on the
        lean hybrid forward, which snapshots the linear state at block-aligned prefixes)."""
        return {"requested": self.config.prefix_cache, "effective": self._kv.prefix_cache}

    @property
    def compile_decode(self) -> dict[str, Any]:
        """``batching.compile_decode`` as configured, whether decode cycles still use it, and why not
        (a bucket that failed to compile turns it off; the engine decodes eagerly)."""
        batches = self._scheduler.batches
        return {"requested": self.config.compile_decode, "effective": batches.compiles,
                "error": batches.compile_error}

    @property
    def family(self) -> dict[str, Any] | None:
        """The model family (kiln.runtime.model_family) when the loader recorded it."""
        family = getattr(self.loaded, "family", None)
        return family.as_dict() if family is not None else None

    def _probe(self, batches: Batches) -> None:
        """A two-cycle prompt (2 tokens, then 1 carried over) through the engine's own forward, so a
        model the engine cannot run is refused at start-up, naming its architecture, instead of
        failing the first request."""
        kv, states = self._kv, self.states
        row = _ProbeRow([self.tokens.pad_id] * 3)
        try:
            for _ in range(kv.blocks_for(3)):
                row.blocks.append(kv.allocate())
            row.state_slot = states.allocate() if states is not None else -1
            with torch.inference_mode():
                batches.prefill([(row, 2)])
                row.prefilled = row.pos = 2  # the builders never advance a row (the cycle's update does)
                logits, _ = batches.prefill([(row, 1)])
            if logits is None or logits.shape[-1] < 1:
                raise RuntimeError("the probe forward returned no logits")
        except Exception as exc:
            arch = self.family["architecture"] if self.family else type(self.model).__name__
            raise ModelLoadError(f"Kiln's engine cannot run architecture {arch}: a probe forward failed "
                                 f"({type(exc).__name__}: {exc})") from exc
        finally:
            kv.release([b for b in row.blocks if b is not None])
            if row.state_slot is not None and row.state_slot >= 0:
                states.release(row.state_slot)
            kv.release_workspace()

    def _paged_attention(self, dtype: torch.dtype) -> Any:
        """The in-place attention kernel when configured and applicable (CPU, float32), else None."""
        if not (self.config.paged_attention and self.config.lean_forward):
            return None
        if torch.device(self.device).type != "cpu" or dtype != torch.float32:
            return None
        return paged_attention.load()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "Engine":
        self.tokens.warm()
        self._scheduler.start()
        return self

    def stop(self, timeout_s: float = JOIN_TIMEOUT_S) -> bool:
        """Stop the engine thread, waiting at most ``timeout_s``; ``False`` (logged) if it did not end."""
        return self._scheduler.stop(timeout_s)

    @property
    def running(self) -> bool:
        return self._scheduler.running

    @property
    def steps(self) -> int:
        return self._scheduler.steps

    def stats(self) -> dict[str, Any]:
        stats = self._scheduler.stats()
        if self.linear_kernels is not None:
            stats["linear_kernels"] = self.linear_kernels
        return stats

    def health(self) -> tuple[bool, str | None]:
        """``(ok, reason)``: not ok when stopped, failed, or stuck in one step past ``stall_timeout_s``."""
        return self._scheduler.health()

    @property
    def restart_required(self) -> dict[str, str] | None:
        """``{"class", "reason"}`` once a cycle failure latched the engine (kiln.runtime.cycle_faults), else None."""
        return self._scheduler.restart_required

    # -- adapters (public API used by training/adapters code) --------------------
    def activate_adapter(self, name: str, path: Path, revision: str) -> None:
        """Load ``path`` as the new revision of served adapter ``name`` (canary-checked, atomic)."""
        t0 = time.perf_counter()
        self.adapters.activate(name, Path(path), revision, self._canary)
        self.observer.adapter_transition("load", time.perf_counter() - t0)
        self._adapters_changed()

    def deactivate_adapter(self, name: str) -> None:
        t0 = time.perf_counter()
        self.adapters.deactivate(name)
        self.observer.adapter_transition("unload", time.perf_counter() - t0)
        self._adapters_changed()

    def _adapters_changed(self) -> None:
        """Tell ``on_adapters_changed`` (the served-set recorder, set by the composition root) the new set."""
        if self.on_adapters_changed is not None:
            self.on_adapters_changed(self.active_adapters())

    def active_adapters(self) -> dict[str, str]:
        return self.adapters.active()

    def peft_model(self) -> Any:
        return self.adapters.peft_model()

    def delete_private_adapter(self, private_name: str) -> None:
        self.adapters.delete_private(private_name)

    def _canary(self, key: str) -> None:
        """Greedy decode a few tokens with adapter ``key``; caller holds exclusive ownership."""
        ids = self.encode_chat([{"role": "user", "content": CANARY_MESSAGE}])
        seq = torch.tensor([ids], device=self.device)
        fm = self.adapters.forward_model
        with torch.inference_mode():
            for _ in range(CANARY_TOKENS):
                logits = fm(input_ids=seq, adapter_names=[key], use_cache=False).logits[:, -1]
                if not torch.isfinite(logits).all():
                    raise AdapterError("canary generation produced non-finite logits")
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)

    # -- admission ---------------------------------------------------------------
    def _acquire(self, adapter: str | None, count: int) -> tuple[list[str], str | None]:
        """``count`` references on ``adapter``'s current key (``BASE_KEY`` for the base model)."""
        if adapter is None:
            return [BASE_KEY] * count, None
        keys: list[str] = []
        revision = None
        try:
            for _ in range(count):
                key, revision = self.adapters.acquire(adapter)
                keys.append(key)
        except UnknownAdapter:
            self._release(keys)
            raise
        return keys, revision

    def _release(self, keys: list[str]) -> None:
        for k in keys:
            if k != BASE_KEY:
                self.adapters.release(k)

    def _overloaded(self) -> EngineOverloaded:
        return EngineOverloaded(
            f"{self._scheduler.queued} rows are already queued (limit batching.max_queued_rows="
            f"{self.config.max_queued_rows}); retry later"
        )

    def _check_running(self) -> None:
        if not self.running:
            failed = self._scheduler.stats()["failed"]
            raise EngineNotRunning(f"the engine is not running ({failed or 'stopped'}); restart the server")

    def _check_fits(self, tokens: int) -> None:
        """A row of ``tokens`` positions must fit the whole KV pool, or it could never run."""
        kv = self._kv
        if kv.blocks_for(tokens) > kv.capacity:
            raise PromptTooLong(
                f"prompt plus max_tokens ({tokens} tokens) needs {kv.blocks_for(tokens)} KV blocks of "
                f"{kv.block_size} tokens, more than the whole KV budget of {kv.capacity} blocks "
                "(batching.kv_budget_bytes or kv_budget_fraction); shorten the prompt or lower max_tokens"
            )

    def admission(self) -> Admission:
        """Mark a request as being parsed and rendered until :meth:`Admission.end`: an engine
        waking from idle gathers it into the same first prefill."""
        return Admission(self._scheduler.admission_started, self._scheduler.admission_ended)

    def submit(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        *,
        adapter: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        incremental: bool = True,
        private_revision: str | None = None,
    ) -> Submission:
        """Queue one row per entry of ``params`` (the ``n`` choices) for ``prompt_ids``.

        ``incremental=False`` suits callers that only want the finished text (non-streaming
        responses, :meth:`generate`): output still accumulates per token, but the consumer
        is woken once per row, at its end, instead of after every step.

        With ``private_revision`` set, ``adapter`` is a trainer's private PEFT key (never served by
        name) whose weights change between calls: its prefix-cache entries are keyed by
        ``adapter#private_revision``, so a new revision never reuses blocks computed with old weights.
        """
        self._check_running()
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty; send at least one token")
        need = len(prompt_ids) + max(p.max_tokens for p in params)
        if len(prompt_ids) >= self.config.max_model_len or need > self.config.max_model_len:
            raise PromptTooLong(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max(p.max_tokens for p in params)}) "
                f"exceeds the model length limit of {self.config.max_model_len} tokens; shorten the prompt "
                "or lower max_tokens"
            )
        self._check_fits(len(prompt_ids) + max(p.max_tokens for p in params))
        if private_revision is not None and adapter is not None:
            keys, revision = self.adapters.acquire_private(adapter, len(params)), private_revision
        else:
            keys, revision = self._acquire(adapter, len(params))
        cache_key = None if private_revision is None else f"{adapter}#{private_revision}"
        shared_event = asyncio.Event() if loop is not None else None
        streams = [RowStream(i, loop, shared_event, incremental) for i in range(len(params))]
        tok = self.tokens
        rows = [
            Row(s, list(prompt_ids), p, make_generator(p.seed, self.device), k, TextStream(tok.tokenizer, p.stop),
                tok.eos_ids, cache_key)
            for s, p, k in zip(streams, params, keys)
        ]
        for s in streams:
            s.prompt_tokens = len(prompt_ids)
        trace = request_trace.CURRENT.get()
        if trace is not None:  # the recent-request log records this request (server.debug_requests)
            trace.submitted(adapter, revision, prompt_ids, len(rows))
            for r in rows:
                r.trace = trace
        if not self._scheduler.enqueue(rows):
            self._release(keys)
            raise self._overloaded()
        return Submission(streams, adapter, revision, len(prompt_ids), rows, self._scheduler)

    def run_job(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between two cycles, under shared ownership.
        ``fn`` must not take exclusive ownership (it would wait on the engine itself)."""
        return self._scheduler.run_job(fn)

    def score_prompt(self, prompt_ids: list[int], top_k: int, *, adapter: str | None = None,
                     score_from: int = 0) -> Future:
        """Future of per-position prompt logprob rows (first ``None``), see :mod:`kiln.runtime.scoring`.

        The prompt is queued like a generation row (:class:`EngineOverloaded` when the queue is
        full) and prefilled in chunks within the token budget. Cancelling the future before it
        completes cancels the scoring: the engine frees its slot at the next cycle boundary.
        ``score_from``: only the rows from this position on are wanted; rows before it may be ``None``,
        as the prompt's first ``score_from - 1`` tokens may come from the prefix cache (and the prompt's
        blocks are published to it), so a trainer scoring many completions of one prompt computes the
        prompt once.
        """
        self._check_running()
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty; send at least one token")
        if len(prompt_ids) > self.config.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens, more than the limit of {self.config.max_model_len}"
            )
        self._check_fits(len(prompt_ids))
        keys, _ = self._acquire(adapter, 1)
        fut: Future = Future()
        row = ScoreRow(list(prompt_ids), top_k, keys[0], fut, max(0, min(score_from, len(prompt_ids))))
        if not self._scheduler.enqueue([row]):
            self._release(keys)
            raise self._overloaded()
        fut.add_done_callback(lambda f: self._scheduler.cancel([row]) if f.cancelled() else None)
        return fut

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | list[SamplingParams],
        *,
        adapter: str | None = None,
        timeout: float | None = None,
    ) -> list[Completion]:
        """Blocking convenience for in-process callers (training rollouts, evals)."""
        plist = params if isinstance(params, list) else [params]
        sub = self.submit(prompt_ids, plist, adapter=adapter, incremental=False)
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for stream, row in zip(sub.streams, sub._rows):
                text, tokens, reason = [], [], None
                while reason is None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    chunk = stream.next_chunk_sync(left)
                    if chunk is None:
                        raise TimeoutError(f"generation did not finish within {timeout} s")
                    text.append(chunk.text)
                    tokens.extend(chunk.tokens)
                    reason = chunk.finish_reason
                out.append(Completion("".join(text), list(row.generated), reason, tokens, sub.adapter_revision))
        finally:
            sub.cancel()
        return out
