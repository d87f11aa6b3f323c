"""Prometheus metrics of the eval worker, registered on the server's registry (``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

EVAL_DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class EvalMetrics:
    def __init__(self, registry: Any = None):
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = r
        self.runs_queued = Counter("kiln_eval_runs_queued", "Evaluations queued, by kind", ["kind"], registry=r)
        self.runs_finished = Counter("kiln_eval_runs_finished", "Evaluations finished, by kind and final state",
                                     ["kind", "state"], registry=r)
        self.duration = Histogram("kiln_eval_run_duration_seconds", "Wall time of one evaluation, by kind",
                                  ["kind"], buckets=EVAL_DURATION_BUCKETS, registry=r)
        self.samples_scored = Counter("kiln_eval_samples_scored", "Generated samples scored", registry=r)
        self.verdicts = Counter("kiln_eval_gate_verdicts", "Post-train gate verdicts", ["verdict"], registry=r)

    def queued(self, kind: str) -> None:
        self.runs_queued.labels(kind=kind).inc()

    def finished(self, kind: str, state: str, seconds: float) -> None:
        self.runs_finished.labels(kind=kind, state=state).inc()
        self.duration.labels(kind=kind).observe(seconds)

    def samples(self, count: int) -> None:
        self.samples_scored.inc(count)

    def verdict(self, verdict: str) -> None:
        self.verdicts.labels(verdict=verdict).inc()
