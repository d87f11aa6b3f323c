"""Prometheus metrics for OpenEnv runs (joined to the server's registry, served on ``/metrics``).

Labels are closed sets only (run states, termination kinds): environment URLs, adapter names and
run IDs never become metric dimensions.
"""

from __future__ import annotations

from typing import Any

RETURN_BUCKETS = (-10.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 100.0)


class OpenEnvMetrics:
    def __init__(self, registry: Any = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.runs_submitted = Counter("kiln_openenv_runs_submitted", "OpenEnv runs admitted (queued)", registry=r)
        self.runs_finished = Counter("kiln_openenv_runs_finished", "OpenEnv runs finished, by final state",
                                     ["state"], registry=r)
        self.episodes = Counter("kiln_openenv_episodes", "OpenEnv episodes played, by termination kind",
                                ["termination"], registry=r)
        self.returns = Histogram("kiln_openenv_episode_return", "Episode returns (sum of step rewards)",
                                 buckets=RETURN_BUCKETS, registry=r)
        self.env_steps = Counter("kiln_openenv_env_steps", "Environment steps taken", registry=r)
        self.policy_actions = Counter("kiln_openenv_policy_actions", "Actions the policy generated", registry=r)
        self.capacity_retries = Counter("kiln_openenv_capacity_retries",
                                        "Sockets reopened after CAPACITY_REACHED", registry=r)

    def episode(self, termination: str, episode_return: float, steps: int, actions: int) -> None:
        self.episodes.labels(termination=termination).inc()
        self.returns.observe(episode_return)
        self.env_steps.inc(steps)
        self.policy_actions.inc(actions)
