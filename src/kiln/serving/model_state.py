"""``GET /v1/debug/model-state`` (``server.debug_model_state``): the model runtime as it is now.

For a trusted diagnostic boundary (the architecture's debug model-state endpoint): what the
engine holds on the accelerator and around it, in one read. It shows the model's identity,
device, dtype and parameter bytes; the physical adapter state (PEFT wrapping, each served key,
row references, retired keys, private training adapters); the paged KV pool and a hybrid's
linear-state slots; accelerator ownership; the memory budget and its reservations; the training
job running now. It never shows prompt text or weights.
"""

from __future__ import annotations

from typing import Any


def _parameters(model: Any) -> dict[str, Any]:
    seen: set[int] = set()
    count = nbytes = trainable = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        count += p.numel()
        nbytes += p.numel() * p.element_size()
        trainable += p.numel() if p.requires_grad else 0
    return {"count": count, "bytes": nbytes, "requires_grad": trainable, "training_mode": bool(model.training)}


def model_state(state: Any) -> dict[str, Any]:
    engine = state.engine
    stats = engine.stats()
    slots = getattr(engine, "adapters", None)
    trainer = state.trainer
    return {
        "model": {"id": state.model_id, "base_model_sha256": state.model.base_model_sha256,
                  "device": str(state.model.device), "dtype": str(state.model.dtype),
                  "family": getattr(engine, "family", None), "max_model_len": engine.config.max_model_len,
                  "parameters": _parameters(state.model.model)},
        "backend": getattr(engine, "backend", "hf"),
        "engine": {"running": engine.running, "steps": stats.get("steps"), "active_rows": stats.get("active_rows"),
                   "queued_rows": stats.get("queued_rows"), "failed": stats.get("failed"),
                   "prefix_cache": getattr(engine, "prefix_cache", None),
                   "compile_decode": getattr(engine, "compile_decode", None)},
        "kv_cache": {k: v for k, v in stats.items() if k.startswith(("kv_", "prefix_cache_", "linear_state_"))},
        "adapters": slots.describe() if hasattr(slots, "describe") else {"served": engine.active_adapters()},
        "ownership": engine.ownership.snapshot(),
        "memory_budget": state.memory.snapshot() if state.memory is not None else None,
        "training": None if trainer is None else {"running_job": trainer.running_job},
    }
