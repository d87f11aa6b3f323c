"""Pairwise judgments (A/B preferences) and the judge adapters trained on them (docs/evals.md, "Judgments")."""
