"""The examples of a capture run, as the sparse-KD trainers read them: the run's verified available shards,
each shard's examples as columns, and the forward windows that reproduce every recorded context.

Shared by the offline trainer (:mod:`kiln.distill.train`, ``kiln distill train``) and the server's KD job
(:mod:`kiln.training.kd.job`); the tensors a batch of windows becomes are built in
:mod:`kiln.training.losses.kd_batch`. No torch (numpy for the columns).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kiln.canonical import sha256_hex
from kiln.distill import shards
from kiln.distill.contract import Plan, ShardManifest
from kiln.distill.errors import ShardError
from kiln.distill.paths import read_bytes_nofollow


def available_shards(run_root: str | os.PathLike[str]) -> tuple[Plan, list[tuple[Path, ShardManifest]],
                                                             list[dict[str, Any]]]:
    """(plan, [(shard dir, available manifest)] by shard_id, skipped) for one run's root.

    Every shard is fully verified first; only intact available shards of a single
    plan are returned. Anything else is listed in ``skipped`` with its reason. Two
    available shards holding one example, or more tokens than the plan's
    ``planned_tokens``, fail closed (the spec: duplicate records fail closed).
    """
    root = Path(run_root)
    if not root.is_dir():
        raise ShardError(f"{root} is not a capture root directory")
    good: list[tuple[Path, ShardManifest]] = []
    skipped: list[dict[str, Any]] = []
    plans: dict[str | None, Plan] = {}
    verdicts = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir() or entry.is_symlink():
            continue
        verdict = shards.verify_shard(entry)
        if not verdict.ok or verdict.state != "available":
            skipped.append({"path": entry.name, "state": verdict.state, "problems": verdict.problems[:3]})
            continue
        assert verdict.plan is not None  # an intact available shard names its plan
        plans[verdict.plan_sha256] = verdict.plan
        good.append((entry, shards.read_manifest_chain(entry)[-1]))
        verdicts.append(verdict)
    if len(plans) > 1:
        raise ShardError(f"{root} holds shards of {len(plans)} plans; train one run at a time")
    if not good:
        raise ShardError(f"{root} has no intact available shard to train on")
    plan = next(iter(plans.values()))
    problems = shards.run_coverage(verdicts, plan)
    if problems:
        raise ShardError(f"{root}: {'; '.join(problems)}; refusing to consume any shard of this run")
    good.sort(key=lambda x: (x[1].shard_id, x[1].transaction_id))
    ids = [m.shard_id for _d, m in good]
    if len(set(ids)) != len(ids):
        raise ShardError("two available transactions publish the same shard_id; refusing to consume both")
    return plan, good, skipped


def load_shard_examples(shard_dir: Path, head: ShardManifest, plan: Plan) -> list:
    """Columns (``binary.PackedExample``) of every example in a verified shard, in order."""
    import numpy as np

    from kiln.distill.binary import PackedExample, decode_packed_arrays

    out = []
    for p in head.payloads:
        raw = read_bytes_nofollow(shard_dir, p.path, max_bytes=shards.MAX_PAYLOAD_BYTES)
        if sha256_hex(raw) != p.sha256:
            raise ShardError(f"{shard_dir.name}/{p.path} changed since verification; refusing to train on it")
        if p.path.endswith(".kdpack"):
            out += decode_packed_arrays(raw, p.path)[1]
            continue
        rows = shards.parse_payload(raw, p.path)
        k = plan.probability.top_k
        groups: dict[str, list] = {}
        for r in rows:
            groups.setdefault(r.example_id, []).append(r)
        for eid, rs in groups.items():
            lp_of = [dict(zip(r.selected_ids, r.selected_logprobs)) for r in rs]
            out.append(
                PackedExample(
                    example_id=eid,
                    context=np.asarray(rs[0].context_token_ids, np.int64),
                    forced=np.asarray([r.forced_token_id for r in rs], np.int64),
                    top_ids=np.asarray([r.top_k_ids for r in rs], np.int64).reshape(len(rs), k),
                    top_logprobs=np.asarray([[m[i] for i in r.top_k_ids] for r, m in zip(rs, lp_of)], np.float64),
                    forced_logprobs=np.asarray(
                        [np.nan if r.forced_token_id in r.top_k_ids else m[r.forced_token_id] for r, m in zip(rs, lp_of)],
                        np.float64,
                    ),
                    tail=np.asarray([r.tail_mass for r in rs], np.float64),
                    entropy=np.asarray([r.entropy for r in rs], np.float64),
                )
            )
    return out


def forward_windows(examples: list, limit: int) -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """Forward rows: (tokens, [(offset, example index, position)]) reproducing each recorded context."""
    out = []
    for n, e in enumerate(examples):
        ctx, forced = [int(x) for x in e.context], [int(x) for x in e.forced]
        full = ctx + forced[:-1]
        if len(full) <= limit:
            out.append((full, [(len(ctx) - 1 + i, n, i) for i in range(len(forced))]))
            continue
        seq = list(ctx)
        for i in range(len(forced)):
            window = seq[-limit:]
            out.append((window, [(len(window) - 1, n, i)]))
            seq.append(forced[i])
    return out
