"""State machines of autodistill v1: example lifecycle, shard states and the
shard-manifest chain.

Every machine is a closed table of allowed (from, to) steps. A step that is not
in the table (a skip, a move backwards, or any move out of a terminal state)
raises ``TransitionError``; nothing is ever rewritten in place.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kiln.distill.contract import ShardManifest
from kiln.distill.errors import TransitionError

__all__ = [
    "EXAMPLE_TRANSITIONS",
    "EXAMPLE_TERMINAL",
    "SHARD_TRANSITIONS",
    "SHARD_TERMINAL",
    "check_transition",
    "advance_example",
    "advance_shard",
    "check_manifest_step",
    "check_manifest_chain",
]

# The spec's example diagram, read column by column (see docs/distill.md):
#
#   proposed -> probed -> captured -> verified -> admitted
#                 |          |            -> rejected
#                 |          -> quarantined
#                 -> rejected / quarantined
#
# A proposal is always probed first; the probe may reject (e.g. the teacher
# brings no verified advantage) or quarantine (both fail / verifier disagreement);
# a capture may be quarantined (corrupt or invalid probabilities); verification
# admits or rejects. No other edge exists: a decision is final, and reconsidering
# an example creates a new example/version.
EXAMPLE_TRANSITIONS: Mapping[str, frozenset[str]] = {
    "proposed": frozenset({"probed"}),
    "probed": frozenset({"captured", "rejected", "quarantined"}),
    "captured": frozenset({"verified", "quarantined"}),
    "verified": frozenset({"admitted", "rejected"}),
    "admitted": frozenset(),
    "rejected": frozenset(),
    "quarantined": frozenset(),
}
EXAMPLE_TERMINAL = frozenset(s for s, nxt in EXAMPLE_TRANSITIONS.items() if not nxt)

# Shards publish write-last; any live state may be quarantined, which is final.
SHARD_TRANSITIONS: Mapping[str, frozenset[str]] = {
    "staging": frozenset({"complete", "quarantined"}),
    "complete": frozenset({"verified", "quarantined"}),
    "verified": frozenset({"available", "quarantined"}),
    "available": frozenset({"quarantined"}),
    "quarantined": frozenset(),
}
SHARD_TERMINAL = frozenset(s for s, nxt in SHARD_TRANSITIONS.items() if not nxt)


def check_transition(table: Mapping[str, frozenset[str]], kind: str, current: str, nxt: str) -> str:
    """Return ``nxt`` if ``current -> nxt`` is in ``table``; else raise ``TransitionError``."""
    if current not in table or nxt not in table:
        raise TransitionError(f"unknown {kind} state in {current!r} -> {nxt!r}")
    if nxt not in table[current]:
        if not table[current]:
            raise TransitionError(
                f"{kind} state {current!r} is terminal; create a new {kind} instead of moving it to {nxt!r}"
            )
        allowed = ", ".join(sorted(table[current]))
        raise TransitionError(
            f"{kind} cannot go {current!r} -> {nxt!r} (allowed next: {allowed}); "
            "steps may not be skipped and edges absent from the spec's diagram do not exist"
        )
    return nxt


def advance_example(current: str, nxt: str) -> str:
    return check_transition(EXAMPLE_TRANSITIONS, "example", current, nxt)


def advance_shard(current: str, nxt: str) -> str:
    return check_transition(SHARD_TRANSITIONS, "shard", current, nxt)


def check_manifest_step(prev: ShardManifest, nxt: ShardManifest) -> None:
    """One link of the chain: legal state step, same identity, predecessor hash bound.

    From ``complete`` on, the payload commitments are frozen: later states may not
    change a single path, size, count or hash (a quarantine keeps them as evidence).
    """
    advance_shard(prev.state, nxt.state)
    for field in ("shard_id", "transaction_id", "plan_sha256", "tokenizer_sha256", "dataset_sha256"):
        if getattr(prev, field) != getattr(nxt, field):
            raise TransitionError(f"manifest {nxt.state!r} changes {field}; a transaction keeps one identity")
    if nxt.previous_manifest_sha256 != prev.digest():
        raise TransitionError(
            f"manifest {nxt.state!r} does not name the canonical hash of its {prev.state!r} predecessor"
        )
    if prev.state != "staging" and (prev.payloads, prev.rows, prev.tokens) != (nxt.payloads, nxt.rows, nxt.tokens):
        raise TransitionError(f"manifest {nxt.state!r} alters payload commitments fixed at {prev.state!r}")


def check_manifest_chain(chain: Sequence[ShardManifest]) -> ShardManifest:
    """Validate a whole chain, oldest first, and return its newest manifest."""
    if not chain:
        raise TransitionError("empty manifest chain")
    if chain[0].state != "staging":
        raise TransitionError(f"a manifest chain starts at 'staging', not {chain[0].state!r}")
    for prev, nxt in zip(chain, chain[1:]):
        check_manifest_step(prev, nxt)
    return chain[-1]
