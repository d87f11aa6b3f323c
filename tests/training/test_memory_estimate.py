"""The memory admission arithmetic: the budget's 409/507 classification and reservations
(kiln.runtime.memory_budget), and a job's estimate on the built-in model (kiln.training.core.memory_estimate).
The same paths run over a real server in tests/serving/test_memory_admission.py."""

from __future__ import annotations

import threading

import pytest

from kiln.errors import Conflict, InsufficientMemory
from kiln.runtime.memory_budget import MemoryBudget
from kiln.training.core.memory_estimate import ACTIVATION_FACTOR, LORA_BYTES_PER_PARAM, estimate_job, model_dims


def test_budget_classifies_never_fits_and_not_now_and_releases():
    resident = {"weights": 300, "kv_cache": 100}
    budget = MemoryBudget(10_000, 1_000, lambda: resident)  # the cap lowers the detected memory
    assert budget.budget_bytes == 1_000 and budget.snapshot()["available_bytes"] == 600
    adapter = budget.reserve("adapter", "a@1", {"adapter_weights": 250}, what="loading a")
    with pytest.raises(InsufficientMemory) as never:
        budget.reserve("training", "job-1", {"lora": 400, "activations": 201}, what="the job")
    assert never.value.status == 507 and never.value.code == "memory_budget_exceeded"
    assert "601 bytes" in never.value.message and "1000 bytes" in never.value.message
    with pytest.raises(Conflict) as now:
        budget.reserve("training", "job-1", {"lora": 400}, what="the job")
    assert now.value.status == 409 and now.value.code == "memory_reserved" and "a@1" in now.value.message
    budget.check("training", "job-1", {"lora": 400}, what="the job", ignore_owners={"a@1"})  # a replaced revision
    budget.release(adapter)
    budget.release(adapter)  # idempotent
    job = budget.reserve("training", "job-1", {"lora": 400}, what="the job")
    assert budget.snapshot()["reservations"] == [job.public()] and budget.snapshot()["available_bytes"] == 200
    budget.check("training", "submission", {"lora": 500}, what="a queued job", ignore_kinds=frozenset({"training"}))
    budget.release(job)
    assert budget.snapshot()["reserved_bytes"] == 0


def test_adapter_reservations_follow_the_served_set():
    budget = MemoryBudget(1_000, 0, lambda: {})
    assert budget.cap_bytes == 0 and budget.budget_bytes == 1_000
    budget.reserve("adapter", "a@1", {"adapter_weights": 100}, what="a")
    budget.record("adapter", "b@2", {"adapter_weights": 50})  # loaded by a job's auto_load
    assert budget.record("adapter", "b@2", {"adapter_weights": 999}).bytes == 50  # kept
    loading = budget.reserve("adapter", "c@3", {"adapter_weights": 10}, what="c", pending=True)
    budget.keep_only("adapter", {"b@2"})  # another adapter's change: c is still loading, a was unloaded
    assert budget.owners("adapter") == {"b@2", "c@3"} and budget.reserved_bytes() == 60
    budget.settle(loading)
    budget.keep_only("adapter", {"b@2"})  # c's load failed after all, or it was unloaded since
    assert budget.owners("adapter") == {"b@2"} and budget.reserved_bytes() == 50


def test_concurrent_reservations_never_overcommit():
    budget = MemoryBudget(1_000, 0, lambda: {"weights": 0})
    won: list[str] = []

    def take(i: int) -> None:
        try:
            budget.reserve("adapter", f"x@{i}", {"adapter_weights": 300}, what="x")
            won.append(f"x@{i}")
        except Conflict:
            pass

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 3 and budget.reserved_bytes() == 900


@pytest.fixture(scope="module")
def dims(builtin_model_dir):
    from kiln.runtime.loader import load_model

    loaded = load_model(builtin_model_dir, device="cpu")
    return model_dims(loaded.model, 4, 256)


def test_job_estimate_parts_on_the_builtin_model(dims):
    from kiln.training.core.data import Row
    from kiln.training.losses.chunked import CHUNK_ELEMENTS
    from kiln.training.sft.job import SFTData

    rows = SFTData(tuple(Row([1] * n, [1] * n) for n in (10, 30, 20)))
    request = {"batch_size": 2, "max_seq_len": 256, "lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}
    parts = estimate_job("sft", request, rows, dims)
    q = dims.linear_dims["q_proj"]
    assert len(q) == dims.layers == 2
    lora = sum(8 * (i + o) for name in ("q_proj", "v_proj") for i, o in dims.linear_dims[name])
    assert parts["lora"] == lora * LORA_BYTES_PER_PARAM
    tokens = 2 * 30  # two sequences of the longest row
    assert parts["activations"] == tokens * dims.hidden * 4 * dims.layers * ACTIVATION_FACTOR
    assert parts["lm_head_chunk"] == 2 * 4 * min(CHUNK_ELEMENTS, tokens * dims.vocab)
    assert parts["teacher_topk"] == 0
    checkpointed = estimate_job("sft", request | {"gradient_checkpointing": True}, rows, dims)
    assert checkpointed["activations"] < parts["activations"]
    opd = estimate_job("opd", request | {"top_k": 8, "samples_per_prompt": 4}, None, dims)
    assert opd["teacher_topk"] == 2 * 4 * 256 * 9 * 24  # sequences x max_seq_len x (top_k + sampled) x bytes
