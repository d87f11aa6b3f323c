"""How long an engine step takes, as a function of the tokens it carries, learned online.

A step's wall time on these engines is close to affine in the tokens it feeds:
a fixed part (Python, per-layer dispatch, streaming the weights once) plus a
part per token (the matmul arithmetic and attention). :class:`StepCost` keeps
an exponentially weighted least-squares fit ``seconds ~ a + b * tokens`` over
the steps the scheduler ran, so the scheduler can ask how many prompt tokens
fit beside the decoding rows before the step gets longer than a set factor of a
decode-only one: the time-between-tokens the decoding streams see.

Weights decay per observation (``forget``), so the fit follows a change of
load, adapter mix or context length within tens of steps. It answers nothing
until the steps it has seen differ enough in size to separate ``a`` from
``b`` (a run of identical decode steps alone cannot), and a fit whose slope is
not positive (noise, or a model so small that every step costs the same)
answers "no limit".
"""

from __future__ import annotations

MIN_SPREAD_TOKENS = 2.0  # weighted std-dev of the step sizes seen before the slope is trusted


class StepCost:
    """Online fit of step seconds as ``a + b * tokens`` with exponential forgetting."""

    __slots__ = ("forget", "_w", "_n", "_nn", "_t", "_nt", "steps")

    def __init__(self, forget: float = 0.98):
        if not 0.0 < forget < 1.0:
            raise ValueError(f"forget must be in (0, 1), got {forget}")
        self.forget = forget
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one step that fed ``tokens`` tokens and took ``seconds``."""
        if tokens <= 0 or seconds <= 0.0:
            return
        f = self.forget
        self._w = self._w * f + 1.0
        self._n = self._n * f + tokens
        self._nn = self._nn * f + tokens * tokens
        self._t = self._t * f + seconds
        self._nt = self._nt * f + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds and seconds per token, or None while the sizes seen are too alike."""
        if self._w <= 0.0:
            return None
        mean_n = self._n / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < MIN_SPREAD_TOKENS ** 2:
            return None
        b = (self._nt / self._w - mean_n * self._t / self._w) / var_n
        a = self._t / self._w - b * mean_n
        return a, b

    def predict(self, tokens: int) -> float | None:
        """Expected seconds for a step of ``tokens`` tokens (None without a fit)."""
        fit = self.fit()
        return None if fit is None else max(0.0, fit[0] + fit[1] * tokens)

    def extra_tokens(self, base_tokens: int, factor: float) -> int | None:
        """How many tokens may join a step of ``base_tokens`` so that it is expected to take at
        most ``factor`` times as long; None when there is no usable fit (no limit)."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        if b <= 0.0:
            return None
        base = a + b * base_tokens
        if base <= 0.0:
            return None
        return int((factor - 1.0) * base / b)

    def snapshot(self) -> dict[str, float | int | None]:
        """The fit for stats: fixed ms per step, ms per token, steps observed."""
        fit = self.fit()
        return {"fixed_ms": None if fit is None else round(1000 * fit[0], 3),
                "per_token_ms": None if fit is None else round(1000 * fit[1], 4),
                "steps": self.steps}
