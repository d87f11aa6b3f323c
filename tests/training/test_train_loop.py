"""TrainLoop, the one loop every job kind composes: cancel, the learned check, steps without an update."""

from __future__ import annotations

import pytest

from kiln.training.core.errors import JobCancelled
from kiln.training.core.loop import Hooks, Learned, Plan, StepInput, TrainLoop
from kiln.training.core.lora import add_private_adapter, lora_config


@pytest.fixture()
def peft_model(builtin_model_dir):
    from peft import get_peft_model

    from kiln.runtime.loader import load_model

    lm = load_model(builtin_model_dir, device="cpu")
    model = get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle")
    add_private_adapter(model, "job", lora_config(2, 4, ["q_proj"]), seed=0)
    return model


def _loss(loop: TrainLoop):
    """A loss of the private weights alone (every step moves them)."""
    return lambda batch: sum(((p - batch) ** 2).sum() for p in loop.params)


def _counted(drawn: list[int], n: int):
    for i in range(n):
        drawn.append(i)
        yield StepInput(1.0, tokens=4, cursor=(0, i + 1))


def test_cancel_stops_before_the_next_step_is_drawn(peft_model):
    loop = TrainLoop(peft_model, "job", Plan(1e-2, 1, 1, 0), Hooks(should_cancel=lambda: loop.step >= 2), 10, None)
    drawn: list[int] = []
    with pytest.raises(JobCancelled) as info:
        loop.train(_counted(drawn, 10), _loss(loop))
    assert info.value.step == 2 and drawn == [0, 1]  # the third step's batch was never prepared
    assert peft_model.active_adapter == "idle"  # the adapter that was active before is back


def test_learned_check_stops_the_job_and_is_recorded(peft_model):
    loop = TrainLoop(peft_model, "job", Plan(1e-2, 1, 1, 0), Hooks(), 10, None)
    calls: list[int] = []

    def learned() -> bool:
        calls.append(loop.step)
        return loop.step >= 4

    loop.train(_counted([], 10), _loss(loop), learned=Learned(2, learned))
    assert calls == [2, 4]  # every second step
    assert (loop.step, loop.total_steps, loop.stats["learned_at_step"], loop.stats["learned"]) == (4, 4, 4, True)
    assert loop.report().as_dict()["steps"] == 4


def test_final_learned_check_runs_once_after_the_last_step(peft_model):
    loop = TrainLoop(peft_model, "job", Plan(1e-2, 1, 1, 0), Hooks(), 3, None)
    calls: list[int] = []
    loop.train(_counted([], 3), _loss(loop), learned=Learned(5, lambda: calls.append(loop.step) or False, final=True))
    assert calls == [3] and loop.stats["learned"] is False and "learned_at_step" not in loop.stats


def test_a_step_without_a_batch_moves_the_cursor_but_not_the_weights(peft_model):
    loop = TrainLoop(peft_model, "job", Plan(1e-2, 1, 1, 0), Hooks(), 2, None)
    before = [p.detach().clone() for p in loop.params]
    after: list[int] = []
    steps = iter([StepInput(None, cursor=(0, 7)), StepInput(1.0, tokens=3, cursor=(0, 8), after=lambda: after.append(1))])
    loop.train(steps, _loss(loop))
    assert loop.step == 1 and loop.batch == 8 and loop.tokens == 3 and after == [1]
    assert any(not (b == p).all() for b, p in zip(before, loop.params))
