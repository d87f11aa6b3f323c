"""Typed errors of the distillation contract.

Each carries a stable ``code`` that the CLI prints in its ``{"error": ...}``
refusal, so scripts can branch on the kind of failure.
"""

from __future__ import annotations


class DistillError(ValueError):
    """Base class: an artifact or request violates the autodistill v1 contract."""

    code = "distill_error"


class ContractError(DistillError):
    """A JSON document does not match its v1 schema (unknown field, bad value, ...)."""

    code = "invalid_artifact"


class UnknownSchemaError(ContractError):
    """The ``schema`` discriminator names an unknown artifact or major version."""

    code = "unknown_schema"


class ProbabilityError(DistillError):
    """A capture row's probabilities are non-finite or inconsistent."""

    code = "invalid_probabilities"


class EstimateError(DistillError):
    """Estimate inputs are out of range or a stored estimate was altered."""

    code = "invalid_estimate"


class TransitionError(DistillError):
    """A state machine was asked to skip a step or leave a terminal state."""

    code = "invalid_transition"


class LedgerError(DistillError):
    """A consumption event breaks the ledger rules (sequence, view, replay, checkpoint)."""

    code = "invalid_ledger"


class PathSafetyError(DistillError):
    """A path is absolute, not normalized, escapes its root, or crosses a symlink."""

    code = "unsafe_path"


class ShardError(DistillError):
    """A shard cannot be written, verified or published as asked."""

    code = "shard_error"
