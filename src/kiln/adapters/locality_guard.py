"""The locality guard: an adapter whose locality falls under the configured thresholds is not served on its own.

A training job measures its adapter's locality (:mod:`kiln.training.core.locality`). Before the job activates the
adapter by itself (``auto_load``, ``post_eval.activate_on_pass``, ``post_eval.set_default_on_pass``) it asks
:func:`guard_verdict`; an adapter under ``[locality]`` ``min_unchanged`` / ``max_degenerate`` / ``max_kl`` is
published but held back, and the verdict (code ``locality_below_threshold``, or ``locality_not_measured``
when the measure failed) names the figures. A job whose measure was turned off (``locality.measure``) is not
judged. The operator admits it anyway with the job's
``locality.override``, or turns the guard off with ``locality.guard = false``; loading it by hand
(``POST /v1/adapters/{name}/load``) is not guarded. :func:`check_locality` is the raising form, for a caller
that answers the request itself (409). Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.errors import Conflict

HINT = ("the job's adapter changed what the model answers away from what it was taught; lower learning_rate, "
        "train fewer steps or add rehearsal, or admit it anyway with the job's locality.override = true "
        "(docs/adapters.md, \"Locality guard\")")


class LocalityBelowThreshold(Conflict):
    code = "locality_below_threshold"
    default_hint = HINT


class LocalityNotMeasured(Conflict):
    code = "locality_not_measured"
    default_hint = ("the guard needs the job's locality; leave locality.measure on, or admit the adapter with "
                    "locality.override = true")


@dataclass(frozen=True)
class GuardPolicy:
    """The thresholds (``[locality]`` of kiln.config): ``enabled`` is ``locality.guard``."""

    enabled: bool = True
    min_unchanged: float = 0.8
    max_degenerate: int = 0
    max_kl: float = 0.0  # 0: no bound

    @classmethod
    def from_settings(cls, section: Any) -> GuardPolicy:
        """From ``settings.locality`` (:class:`kiln.config.LocalitySettings`)."""
        return cls(enabled=section.guard, min_unchanged=section.min_unchanged,
                   max_degenerate=section.max_degenerate, max_kl=section.max_kl)


def shortfalls(locality: dict[str, Any], policy: GuardPolicy) -> list[str]:
    """Each threshold ``locality`` (a job's figures) misses, with the figures; empty when it passes."""
    out = []
    frac = locality.get("unchanged_fraction")
    if frac is not None and frac < policy.min_unchanged:
        out.append(f"{locality.get('unchanged')} of {locality.get('probes')} probe answers unchanged "
                   f"({frac:.2f} < min_unchanged {policy.min_unchanged:.2f})")
    degenerate = int(locality.get("degenerate") or 0)
    if degenerate > policy.max_degenerate:
        out.append(f"{degenerate} probe answers degenerate (> max_degenerate {policy.max_degenerate})")
    kl = locality.get("kl_mean")
    if policy.max_kl > 0 and kl is not None and kl > policy.max_kl:
        out.append(f"mean KL(base || adapter) {kl:.4f} nats per token (> max_kl {policy.max_kl:g})")
    return out


def check_locality(locality: dict[str, Any] | None, policy: GuardPolicy) -> None:
    """Raise :class:`LocalityBelowThreshold` when the guard is on and the figures miss a threshold, or
    :class:`LocalityNotMeasured` when the measure ran and produced none (it failed, or found no probes); return
    when the adapter may be activated. ``None`` (the measure was turned off, as asked) passes."""
    if not policy.enabled or locality is None:
        return
    if not locality.get("probes"):
        why = locality.get("error") or "the probe set is empty (the model wrote no probe questions)"
        raise LocalityNotMeasured(f"locality guard: {why}")
    missed = shortfalls(locality, policy)
    if missed:
        raise LocalityBelowThreshold("locality guard: " + "; ".join(missed))


def guard_verdict(locality: dict[str, Any] | None, policy: GuardPolicy, *, override: bool = False
                  ) -> dict[str, Any]:
    """The guard's verdict on activating an adapter with these figures (:func:`check_locality`): ``admitted``
    (bool), ``override``, the ``thresholds``, and ``code`` and ``reason`` when the figures miss (then
    ``admitted`` is the override)."""
    verdict: dict[str, Any] = {"enabled": policy.enabled, "override": override, "thresholds": asdict(policy),
                               "admitted": True, "code": None, "reason": None}
    try:
        check_locality(locality, policy)
    except (LocalityBelowThreshold, LocalityNotMeasured) as exc:
        verdict.update(admitted=override, code=exc.code, reason=exc.message)
    return verdict


BELOW, NOT_MEASURED = LocalityBelowThreshold.code, LocalityNotMeasured.code
