"""torch.distributed for LoRA jobs under torchrun: the process group, DDP over the adapter, rank-0 I/O.

Kiln does not run its own distributed runtime: torchrun starts the processes
and sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``;
:func:`init_world` joins that process group (gloo on CPU, NCCL on CUDA) and
:func:`run_sft_distributed` trains the job's private LoRA adapter with
``DistributedDataParallel`` over the adapter's parameters only (the base
weights are frozen and left out of DDP's broadcasts and buckets), or with FSDP.

Arithmetic (the same as :func:`kiln.training.sft.job.run_sft` in one process):
every rank walks the same ``epoch_order(seed, epoch)``; global batch ``b`` is
the plan's ``batch_size`` rows at positions ``b*B .. b*B+B-1`` of that order;
rank ``r`` takes rows ``r, r+W, r+2W, ...`` of it and runs them in micro-batches
of ``micro_batch_size`` (gradient accumulation, ``no_sync`` until the last
one). Each micro-batch contributes ``W * sum(token CE) / N`` where ``N`` is the
global batch's target-token count (every rank knows all rows), so DDP's mean
over ranks is the one-process token mean ``sum(token CE) / N``. A rank whose
share of a short last batch is empty still joins the all-reduce (one forward
with its loss scaled by zero).

With ``fsdp`` the base is sharded too (FSDP2 ``fully_shard`` per decoder layer,
then the rest): the same arithmetic, with the adapter's optimizer state sharded
and gathered to full tensors for checkpoints and publication.

Checkpoints and publication are rank 0's; the others wait at a barrier. A
checkpoint records the world size, and a resume with another world size is
refused (:class:`WorldSizeMismatch`).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch

from kiln.errors import InvalidRequest
from kiln.training.core.checkpoints import Checkpoint
from kiln.training.core.data import Row, batches_per_epoch, collate
from kiln.training.core.errors import TrainingFailed
from kiln.training.core.loop import Hooks, Plan, Report, StepInput, TrainLoop, _adamw, epoch_batches
from kiln.training.core.lora import adapter_state, private_parameters
from kiln.training.losses.chunked import chunk_rows, linear_cross_entropy_sum, split_causal_lm
from kiln.training.losses.sft import sft_loss
from kiln.training.sft.job import learned_by, record_stop, sft_learned

# A collective that waits longer than this (a rank hung, not dead) fails the job instead of hanging it.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
WORLD_SIZE_KEY = "world_size"


class DistributedError(InvalidRequest):
    """The distributed set-up cannot run this job (a caller's choice, never a crash)."""

    code = "distributed_unsupported"


class WorldSizeMismatch(DistributedError):
    code = "world_size_mismatch"


class RanksDisagree(DistributedError):
    code = "ranks_disagree"


@dataclass(frozen=True)
class World:
    """This process's place in the torchrun world (``world_size == 1``: no process group)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # "gloo", "nccl", or None without a process group
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_world(device: str = "auto", *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> World:
    """Join torchrun's process group: NCCL with one CUDA device per local rank, else gloo on CPU.

    Without torchrun's environment (no ``WORLD_SIZE``), a single-process world on ``device``.
    """
    import torch.distributed as dist

    from kiln.runtime.loader import resolve_device

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return World(0, 1, 0, None, dev)
    if dev.startswith("cuda"):
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DistributedError(
                f"local rank {local_rank} has no CUDA device (this host has {count})",
                hint="start at most one process per GPU: --nproc_per_node <= the number of GPUs")
        dev = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World(dist.get_rank(), dist.get_world_size(), local_rank, backend, dev)


def close_world(world: World) -> None:
    import torch.distributed as dist

    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def broadcast_object(world: World, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; for small state such as IDs, results, LoRA checkpoints)."""
    if not world.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0, device=torch.device(world.device) if world.backend == "nccl" else None)
    return box[0]


def check_same(world: World, what: str, value: Any) -> None:
    """Refuse to go on unless every rank holds the same ``value`` (data, model and plan identity)."""
    if not world.distributed:
        return
    import torch.distributed as dist

    values: list[Any] = [None] * world.world_size
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        diff = ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))
        raise RanksDisagree(f"the ranks disagree on {what} ({diff})",
                            hint="every node needs the same model files, data and request")


def all_min(world: World, value: float) -> float:
    if not world.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def checkpoint_world_size(ckpt: Checkpoint) -> int:
    """The world size a checkpoint was written by (checkpoints from one process carry none: 1)."""
    return int((ckpt.stats.get("extra") or {}).get(WORLD_SIZE_KEY, 1))


def check_resume_world(ckpt: Checkpoint | None, world: World) -> None:
    if ckpt is None:
        return
    have = checkpoint_world_size(ckpt)
    if have != world.world_size:
        raise WorldSizeMismatch(
            f"checkpoint {ckpt.path.name} was written by {have} process(es); this run has {world.world_size}",
            hint=f"resume with the same world size (--nproc_per_node x --nnodes = {have}); a resume with another "
                 "world size would change the per-rank data split and is refused")


# ------------------------------------------------------------------ the wrapped model


class SFTLossSum(torch.nn.Module):
    """The module DDP or FSDP wraps: ``(input_ids [B,T], loss_mask [B,T]) -> sum of target-token CE`` (fp32).

    It holds the ``PeftModel`` so that DDP/FSDP see the adapter's parameters; the
    head runs chunk by chunk (:func:`kiln.training.losses.chunked.split_causal_lm`)
    where the model allows it, else through the full logits. With ``margin`` it
    returns instead the smallest ``logit(target) - max(logit(other))`` over the
    targets (:class:`kiln.training.core.loop.LearnedCheck`), so that under FSDP the
    check runs inside the sharded module's forward like a step does.
    """

    def __init__(self, peft_model: Any):
        super().__init__()
        self.peft_model = peft_model
        self._split = split_causal_lm(peft_model)

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, margin: bool = False) -> torch.Tensor:
        split = self._split
        rows, cols = loss_mask[:, 1:].bool().nonzero(as_tuple=True)
        targets = input_ids[rows, cols + 1]
        if split is None:
            logits = self.peft_model(input_ids=input_ids, use_cache=False).logits
            if margin:
                return _min_margin(logits[rows, cols].float(), targets)
            return sft_loss(logits, input_ids, loss_mask) * int(rows.numel())
        hidden = split.hidden(input_ids)[rows, cols]
        weight = split.head.weight
        if not margin:
            return linear_cross_entropy_sum(hidden, weight, targets)
        worst = torch.full((), math.inf, device=hidden.device)
        step = chunk_rows(weight.shape[0])
        for s in range(0, hidden.shape[0], step):
            worst = torch.minimum(worst, _min_margin((hidden[s:s + step] @ weight.t()).float(), targets[s:s + step]))
        return worst


def _min_margin(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``min_n logits[n, y_n] - max_{v != y_n} logits[n, v]`` (``[N, V]``, ``[N]``; inf when N is 0)."""
    if logits.shape[0] == 0:
        return torch.full((), math.inf, device=logits.device)
    t = targets.unsqueeze(-1)
    return (logits.gather(-1, t).squeeze(-1) - logits.scatter(-1, t, float("-inf")).amax(-1)).min()


def wrap_ddp(peft_model: Any, params: Sequence[torch.nn.Parameter], world: World) -> Any:
    """``DistributedDataParallel`` over the adapter's ``params`` only.

    Every other parameter and every buffer (the frozen base, other adapters) is
    registered as ignored, so DDP neither broadcasts the base weights at start
    nor buckets them; the ranks' base identity is checked by digest instead.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = SFTLossSum(peft_model)
    _only_adapter_trainable(module, params)
    trainable = {id(p) for p in params}
    ignored = [n for n, p in module.named_parameters() if id(p) not in trainable]
    ignored += [n for n, _ in module.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    device_ids = [torch.device(world.device).index] if world.backend == "nccl" else None
    return DDP(module, device_ids=device_ids, find_unused_parameters=False)


def _only_adapter_trainable(module: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
    trainable = {id(p) for p in params}
    extra = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in trainable]
    if extra:
        raise TrainingFailed(f"parameters outside the job's adapter are trainable: {extra[:3]}")


def wrap_fsdp(peft_model: Any, loop: TrainLoop, world: World) -> Any:
    """FSDP2 (``fully_shard``): each decoder layer, then the rest, sharded across the ranks.

    The base weights are sharded too, so each rank holds about ``1/W`` of them
    between layers (plus one layer gathered at a time). ``loop``'s optimizer is
    rebuilt over the sharded adapter parameters, with any restored state
    (a resumed checkpoint holds full tensors) sharded the same way.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    module = SFTLossSum(peft_model)
    _only_adapter_trainable(module, loop.params)
    mesh = init_device_mesh(torch.device(world.device).type, (world.world_size,))
    stacks = [m for n, m in peft_model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith(".layers")]
    if not stacks:
        raise DistributedError("--fsdp needs a model with a `layers` list of decoder layers")
    for layer in stacks[0]:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    old_params, old_opt = loop.params, loop.opt
    loop.params = private_parameters(peft_model, loop.name)
    loop.device = torch.device(world.device)
    loop.opt = _adamw(loop.params, loop.plan.learning_rate, loop.plan.weight_decay)
    for old, new in zip(old_params, loop.params):
        state = old_opt.state.get(old)
        if state:
            loop.opt.state[new] = {k: distribute_tensor(v.to(loop.device), mesh, [Shard(0)]) if v.dim() else v
                                   for k, v in state.items()}
    return module


def _full(value: Any) -> Any:
    """A DTensor gathered into a plain tensor (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(peft_model: Any, loop: TrainLoop) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter's weights and the optimizer's state as plain full tensors (call on every rank)."""
    weights = {k: _full(v) for k, v in adapter_state(peft_model, loop.name).items()}
    opt = loop.opt.state_dict()
    opt["state"] = {i: {k: _full(v) for k, v in st.items()} for i, st in sorted(opt["state"].items())}
    return weights, opt


def unshard_adapter(peft_model: Any, name: str) -> None:
    """Replace the adapter's shards with its gathered full weights (after the last FSDP step; every rank),
    so that the recipe saves and publishes them as it does after any job."""
    for mod_name, module in peft_model.named_modules():
        for leaf, param in list(module.named_parameters(recurse=False)):
            if f".{name}." in f".{mod_name}.{leaf}":
                module._parameters[leaf] = torch.nn.Parameter(_full(param).detach().clone(), requires_grad=False)


# ------------------------------------------------------------------------- SFT


def rank_share(batch_rows: Sequence[int], world: World) -> list[int]:
    """This rank's rows of a global batch: positions ``rank, rank + W, ...``."""
    return list(batch_rows[world.rank::world.world_size])


def target_tokens(rows: Sequence[Row]) -> int:
    return sum(sum(r.loss_mask[1:]) for r in rows)


def _distributed_margin(model: Any, rows: Sequence[Row], world: World, *, pad_id: int, batch_size: int,
                        device: torch.device) -> float:
    """The smallest greedy margin over all rows: each rank checks its share in the same number of forwards
    (FSDP gathers weights in each one), then a MIN all-reduce."""
    mine = list(rows[world.rank::world.world_size])
    calls = math.ceil(math.ceil(len(rows) / world.world_size) / batch_size)
    worst = math.inf
    with torch.no_grad():
        for i in range(calls):
            chunk = mine[i * batch_size:(i + 1) * batch_size]
            batch = collate(chunk or rows[:1], pad_id, device)
            value = float(model(batch["input_ids"], batch["loss_mask"], margin=True))
            worst = min(worst, value) if chunk else worst
    return all_min(world, worst)


class _RankLoop(TrainLoop):
    """The loop on one rank: under FSDP every rank joins the gathers a checkpoint needs, and rank 0 writes it
    (the one-process checkpoint, plus the world size in its stats)."""

    def __init__(self, *args: Any, world: World, fsdp: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.world, self.fsdp = world, fsdp

    def save(self, next_epoch: int, next_batch: int, tensors: dict[str, torch.Tensor] | None = None, **kw: Any
             ) -> Any:
        state = full_state(self.peft_model, self) if self.fsdp else None
        return super().save(next_epoch, next_batch, tensors, state=state, **kw) if self.world.is_main else None


def run_sft_distributed(peft_model: Any, name: str, rows: Sequence[Row], plan: Plan, world: World, *,
                        pad_id: int, micro_batch_size: int | None = None, hooks: Hooks | None = None,
                        resume: Checkpoint | None = None, fsdp: bool = False) -> Report:
    """:func:`kiln.training.sft.job.run_sft` across the ranks of ``world`` (see the module docstring).

    ``hooks.checkpoint_root`` is where rank 0 writes checkpoints (other ranks only join the gathers
    FSDP needs). Returns the same report on every rank.
    """
    unsupported = [k for k in ("gradient_checkpointing", "compile") if getattr(plan, k, False)]
    if unsupported:
        raise DistributedError(f"{', '.join(unsupported)} not supported yet in distributed jobs",
                               hint="leave them off, or run the job on the server")
    packing_skipped = bool(getattr(plan, "packing", False))
    if packing_skipped:  # a speed option (same loss up to rounding) the distributed loop does not apply yet
        plan = replace(plan, packing=False)
    check_resume_world(resume, world)
    if resume is not None and bool((resume.stats.get("extra") or {}).get("fsdp")) != fsdp:
        raise DistributedError("the checkpoint was written " + ("with" if not fsdp else "without") + " --fsdp",
                               code="resume_setting_mismatch",
                               hint="resume with the same --fsdp setting (exact resume needs the same arithmetic)")
    per_epoch = batches_per_epoch(len(rows), plan.batch_size)
    loop = _RankLoop(peft_model, name, plan, hooks or Hooks(), plan.epochs * per_epoch, resume, world=world,
                     fsdp=fsdp)
    loop.stats[WORLD_SIZE_KEY] = world.world_size
    if packing_skipped:
        loop.stats["packing"] = "not applied in distributed jobs"
    if fsdp:
        loop.stats["fsdp"] = True
    with loop.step_ownership():
        model = wrap_fsdp(peft_model, loop, world) if fsdp else wrap_ddp(peft_model, loop.params, world)

    def learned() -> bool:
        with loop.step_ownership():
            margin = _distributed_margin(model, rows, world, pad_id=pad_id, batch_size=plan.batch_size,
                                         device=loop.device)
        return learned_by(loop, margin, plan)

    def steps() -> Iterator[StepInput]:
        for chosen, cursor in epoch_batches(loop, len(rows), plan, per_epoch):
            global_rows = [rows[i] for i in chosen]
            yield StepInput(global_rows, sum(len(r.input_ids) for r in global_rows), cursor)

    loop.train(steps(), lambda global_rows: _rank_step(model, loop, global_rows, world, pad_id=pad_id,
                                                       micro_batch_size=micro_batch_size, fsdp=fsdp),
               learned=sft_learned(plan, learned), at_end=(lambda: unshard_adapter(peft_model, name)) if fsdp else None)
    record_stop(loop, plan)
    return loop.report()


def _rank_step(model: Any, loop: TrainLoop, global_rows: list[Row], world: World, *, pad_id: int,
               micro_batch_size: int | None, fsdp: bool) -> float:
    """This rank's share of one global batch, in micro-batches whose gradients are synchronised once (on
    the last); the batch's loss over every rank's targets, already backpropagated."""
    mine = rank_share(global_rows, world)
    n_targets = target_tokens(global_rows)
    micro = micro_batch_size or max(1, len(mine))
    width = max(len(r.input_ids) for r in global_rows)  # the one-process batch's shape
    chunks = [mine[i:i + micro] for i in range(0, len(mine), micro)] or [global_rows[:1]]
    weight = world.world_size / n_targets if mine else 0.0  # an empty share joins with zero gradients
    total = torch.zeros((), dtype=torch.float64)
    for i, chunk in enumerate(chunks):
        batch = _pad_to(collate(chunk, pad_id, loop.device), width, pad_id)
        last = i == len(chunks) - 1
        if fsdp and last:
            model.set_requires_gradient_sync(True)
        with nullcontext() if last else _no_sync(model, fsdp):
            loss_sum = model(batch["input_ids"], batch["loss_mask"])
            if not torch.isfinite(loss_sum):
                raise TrainingFailed(f"loss became {loss_sum.item()} at step {loop.step + 1}; "
                                     "lower the learning rate")
            (loss_sum * weight).backward()
        total += float(loss_sum.detach()) if mine else 0.0
    return _global_loss(world, total, n_targets)


def _no_sync(model: Any, fsdp: bool) -> Any:
    """Accumulate this micro-batch's gradients without synchronising them."""
    if not fsdp:
        return model.no_sync()
    model.set_requires_gradient_sync(False)
    return nullcontext()


def _pad_to(batch: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a collated micro-batch to ``width`` columns (the global batch's), so every row runs in
    the shape it has in one process."""
    extra = width - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    pad = torch.nn.functional.pad
    return {k: pad(v, (0, extra), value=pad_id if k == "input_ids" else 0) for k, v in batch.items()}


def _global_loss(world: World, local_sum: torch.Tensor, n_targets: int) -> float:
    """The step's token-mean loss over the global batch (one small all-reduce, for the report only)."""
    if world.distributed:
        import torch.distributed as dist

        t = local_sum.to(world.device)
        dist.all_reduce(t)
        local_sum = t.cpu()
    return float(local_sum) / n_targets
