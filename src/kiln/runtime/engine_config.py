"""The engine's limits and switches (:class:`EngineConfig`), resolved from the settings.

The scheduler, the batch builder and both engines read it; ``serving.state`` builds it once per
server (:meth:`EngineConfig.from_settings`), capping ``max_model_len`` at the model's own limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.runtime.threads import engine_prefill_threads

STALL_TIMEOUT_S = 60.0  # one scheduler iteration running longer than this reports the engine stuck


@dataclass(frozen=True)
class EngineConfig:
    token_budget: int = 512
    max_running_rows: int = 32
    max_queued_rows: int = 256
    prefill_chunk_tokens: int = 256
    max_model_len: int = 2048
    stall_timeout_s: float = STALL_TIMEOUT_S
    kv_block_size: int = 16
    kv_budget_bytes: int = 0  # 0: blocks for max_running_rows x max_model_len (CPU pages commit on use)
    kv_budget_fraction: float = 0.0  # instead of bytes: this fraction of RAM (CUDA: of the device's memory)
    prefix_cache: bool = True
    compile_decode: bool = False  # torch.compile the decode step over bucketed static shapes (docs/benchmarks.md)
    burst_gap_s: float = 0.001  # waking from idle: gather rows arriving at most this far apart (0: off)
    burst_max_s: float = 0.010  # ... for at most this long in all
    lean_forward: bool = True  # kiln.runtime.lean_forward (attention models) and kiln.runtime.lean_hybrid (hybrids)
    packed_weights: bool = True  # oneDNN-packed Linear weights in the lean forward (CPU fp32; memory x2 for them)
    paged_attention: bool = True  # decode/packed attention reads KV blocks in place (CPU fp32; C kernel)
    mixed_step_factor: float = 1.5  # prompt tokens beside decoding rows: a cycle <= this x a decode-only one (0: off)
    prefill_threads: int = 0  # torch threads for prompt-only cycles with enough work (0: the engine's own count)

    @classmethod
    def from_settings(cls, settings: Any, model_max_len: int | None = None) -> "EngineConfig":
        """Engine limits from the settings; ``max_model_len`` never exceeds ``model_max_len``
        (the model's ``max_position_embeddings``), as vLLM caps it."""
        b = settings.batching
        m = getattr(settings, "model", None)
        configured = settings.limits.max_model_len
        return cls(
            token_budget=b.token_budget,
            max_running_rows=b.max_running_rows,
            max_queued_rows=b.max_queued_rows,
            prefill_chunk_tokens=b.prefill_chunk_tokens,
            max_model_len=configured if model_max_len is None else min(configured, model_max_len),
            stall_timeout_s=float(getattr(b, "stall_timeout_s", STALL_TIMEOUT_S)),
            kv_block_size=int(getattr(b, "kv_block_size", 16)),
            kv_budget_bytes=int(getattr(b, "kv_budget_bytes", 0)),
            kv_budget_fraction=float(getattr(b, "kv_budget_fraction", 0.0)),
            prefix_cache=bool(getattr(b, "prefix_cache", True)),
            compile_decode=bool(getattr(b, "compile_decode", False)),
            burst_gap_s=float(getattr(b, "burst_gap_s", cls.burst_gap_s)),
            lean_forward=bool(getattr(b, "lean_forward", True)),
            packed_weights=bool(getattr(b, "packed_weights", True)),
            paged_attention=bool(getattr(b, "paged_attention", True)),
            mixed_step_factor=float(getattr(b, "mixed_step_factor", cls.mixed_step_factor)),
            prefill_threads=engine_prefill_threads(m.threads, m.prefill_threads) if m is not None else 0,
        )
