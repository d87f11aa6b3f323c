"""Evals: suites and scorers, the eval worker and its runs, strict replay, the post-train gate (docs/evals.md)."""
