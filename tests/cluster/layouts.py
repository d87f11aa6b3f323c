"""Layouts a caller might write: each runs in every rank of a real world and makes its groups.

They live in a module of their own because the spawned ranks import them by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.cluster.acquire import GridLayout, ParallelGroups

ANOTHER_ENGINE = "engine-of-a-previous-launch"


def _create(rank: int, groups: list[list[int]]) -> Any:
    """Create every group (collectively, in the same order on every rank); return the one holding ``rank``."""
    import torch.distributed as dist

    made = [(ranks, dist.new_group(ranks=ranks)) for ranks in groups]
    return next(group for ranks, group in made if rank in ranks)


def pipeline_2_by_tensor_2(rank: int, world_size: int) -> ParallelGroups:
    """Two pipeline stages, each a TP pair: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3."""
    assert world_size == 4
    return ParallelGroups(
        tensor_parallel=_create(rank, [[0, 1], [2, 3]]),
        pipeline_parallel=_create(rank, [[0, 2], [1, 3]]),
    )


def tensor_2_with_its_stages_left_unlabelled(rank: int, world_size: int) -> ParallelGroups:
    """The same TP pairs, but every rank its own pipeline: labelled pure TP, which four ranks are not."""
    assert world_size == 4
    return ParallelGroups(
        tensor_parallel=_create(rank, [[0, 1], [2, 3]]),
        pipeline_parallel=_create(rank, [[r] for r in range(world_size)]),
    )


def rank_1_belongs_to_another_engine(rank: int, world_size: int) -> ParallelGroups:
    """Pure TP over the world, but rank 1 knows itself to be a worker of another engine."""
    groups = GridLayout(world_size)(rank, world_size)
    return dataclasses.replace(groups, incarnation=ANOTHER_ENGINE) if rank == 1 else groups

