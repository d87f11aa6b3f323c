"""HoldPacer: while serving is busy each training hold gets a budget and serving gets its share between holds;
the gap really lets a waiting serving cycle in before the trainer's next hold."""

from __future__ import annotations

import threading

import pytest

from kiln.runtime.ownership import AcceleratorOwnership, HoldPacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_only_while_serving_is_busy():
    busy = {"v": False}
    pacer = HoldPacer(AcceleratorOwnership(), lambda: busy["v"], serving_share=0.5, max_hold_ms=40)
    assert pacer.budget_s() is None  # idle: whole steps
    busy["v"] = True
    assert pacer.budget_s() == pytest.approx(0.040)
    off = HoldPacer(AcceleratorOwnership(), lambda: True, max_hold_ms=0)
    assert off.budget_s() is None  # 0: no bound


def test_hold_cycles_size_the_budget_from_servings_cycle_within_its_bounds():
    """training.hold_cycles: the budget follows serving's measured cycle (a hold stalls a stream about that many
    of its own steps), never under min_hold_ms, never over max_hold_ms, and max_hold_ms alone without a measure."""
    cycle: dict[str, float | None] = {"s": 0.004}
    pacer = HoldPacer(AcceleratorOwnership(), lambda: True, max_hold_ms=50, hold_cycles=2, min_hold_ms=2,
                      cycle_s=lambda: cycle["s"])
    assert pacer.budget_s() == pytest.approx(0.008)  # 2 x 4 ms
    assert pacer.snapshot()["last_budget_ms"] == pytest.approx(8.0) and pacer.snapshot()["hold_cycles"] == 2
    cycle["s"] = 0.0005
    assert pacer.budget_s() == pytest.approx(0.002)  # 1 ms, raised to the 2 ms floor
    cycle["s"] = 0.2
    assert pacer.budget_s() == pytest.approx(0.050)  # 400 ms, capped at max_hold_ms
    cycle["s"] = None
    assert pacer.budget_s() == pytest.approx(0.050)  # no measure yet (or a vLLM engine): max_hold_ms
    fixed = HoldPacer(AcceleratorOwnership(), lambda: True, max_hold_ms=50, cycle_s=lambda: 0.001)
    assert fixed.budget_s() == pytest.approx(0.050)  # hold_cycles 0 (the default): max_hold_ms alone
    off = HoldPacer(AcceleratorOwnership(), lambda: True, max_hold_ms=0, hold_cycles=2, cycle_s=lambda: 0.004)
    assert off.budget_s() is None  # max_hold_ms 0 still turns slicing off
    idle = HoldPacer(AcceleratorOwnership(), lambda: False, max_hold_ms=50, hold_cycles=2, cycle_s=lambda: 0.004)
    assert idle.budget_s() is None


def test_gap_gives_serving_its_share_after_each_busy_hold():
    clock, slept = FakeClock(), []
    busy = {"v": True}
    pacer = HoldPacer(AcceleratorOwnership(), lambda: busy["v"], serving_share=0.75, max_hold_ms=50,
                      max_gap_s=1.0, clock=clock, sleep=slept.append)
    with pacer.hold():
        clock.now += 0.1  # a 100 ms hold
    assert slept == []  # nothing to yield before the first hold
    with pacer.hold():
        clock.now += 0.5
    assert slept == [pytest.approx(0.3)]  # 0.1 * 0.75 / 0.25: serving gets 75% of the time
    with pacer.hold():
        pass
    assert slept[-1] == pytest.approx(1.0)  # 0.5 * 3 = 1.5, capped at max_gap_s
    busy["v"] = False
    with pacer.hold():
        pass
    assert len(slept) == 2  # idle serving: no gap
    snap = pacer.snapshot()
    assert snap["holds"] == 4 and snap["busy_holds"] == 3 and snap["yields"] == 2
    assert snap["longest_busy_hold_s"] == pytest.approx(0.5)
    none = HoldPacer(AcceleratorOwnership(), lambda: True, serving_share=0.0, clock=clock, sleep=slept.append)
    with none.hold():
        clock.now += 1
    with none.hold():
        pass
    assert len(slept) == 2  # share 0: the trainer never yields


def test_waiting_serving_cycle_runs_between_two_holds():
    """A serving thread that asks for shared ownership during a hold runs before the trainer's next hold (the lock
    is writer-preferring: without the gap the trainer, asking again at once, would go first)."""
    own = AcceleratorOwnership()
    order: list[str] = []
    served = threading.Event()
    asked = threading.Event()

    def serve() -> None:
        asked.set()
        with own.shared():
            order.append("serve")
        served.set()

    # the pacer's "sleep" waits for the serving cycle (bounded), so the order does not hang on timing
    pacer = HoldPacer(own, lambda: True, serving_share=0.5, sleep=lambda s: served.wait(30))
    t = threading.Thread(target=serve)
    with pacer.hold():
        order.append("hold 1")
        t.start()
        asked.wait(30)
    with pacer.hold():
        order.append("hold 2")
    t.join(30)
    assert order == ["hold 1", "serve", "hold 2"]


@pytest.mark.parametrize("kw", [{"serving_share": 1.0}, {"serving_share": -0.1}, {"max_hold_ms": -1},
                                {"hold_cycles": -1}])
def test_refuses_out_of_range_settings(kw):
    with pytest.raises(ValueError):
        HoldPacer(AcceleratorOwnership(), lambda: True, **kw)
