"""Per-row Gated DeltaNet state for hybrid models (Qwen3.5): a slot pool and one forward's view of it.

A linear-attention layer carries two tensors per sequence instead of a growing KV cache:
the causal-convolution window (the last ``conv_kernel`` inputs of its q|k|v convolution,
``[conv_dim, conv_kernel]`` in the model's dtype) and the recurrent matrix of each value
head (``[value_heads, key_dim, value_dim]``, float32 as transformers keeps it). Their size
does not depend on the sequence length, so each running row owns one *slot* of a
:class:`LinearStatePool` holding both tensors for every linear layer: allocated at
admission, released at the row's cleanup (finish, cancel, preemption, engine stop).

:class:`LinearStepState` is what one batched forward sees: it wraps the paged KV step
cache (the full-attention layers) and answers transformers' linear-attention cache
calls (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``) for the batch rows' slots with one gather or scatter per
layer (``index_select``/``index_copy_``: no Python loop over rows or heads). ``fresh``
marks a forward whose rows start from an empty state (their first prompt chunk): it
then reports no previous state, exactly as transformers' own cache does before the
prefill, so a prompt split over several cycles runs the same operations as
``generate``'s prefill followed by its decode steps.

transformers' layer runs the whole chunk through the recurrence, so padding after a
state would decay it: the batch builder left-pads only chunks that start a row's state
(zeroed inputs before an empty state leave it empty) and batches the others by length
(:meth:`kiln.runtime.batches.Batches.prefill`). That is transformers' path; the lean hybrid
forward (kiln.runtime.lean_hybrid) reads and writes the same pool tensors directly, per row,
in packed variable-length cycles (no padding).

:class:`LinearSnapshots` is the hybrid half of the prefix cache: copies of a row's state at
prompt positions that are multiples of ``every`` (``SNAPSHOT_EVERY`` rounded up to whole KV
blocks), taken by the lean hybrid forward while it runs the prompt, keyed by a digest of the
adapter revision key and the prefix's tokens (the identity the KV blocks are cached under). A row
admitted with cached blocks keeps only as many as end at a snapshot and starts from its copy;
at most ``SNAPSHOTS_PER_SLOT`` x slots are kept (least recently used dropped first), and their
bytes come out of the KV budget like the slots'.
"""

from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kiln.runtime.model_family import LINEAR_ATTENTION, layer_types


@dataclass(frozen=True)
class LinearLayerShape:
    layer: int  # the decoder layer's index in the model
    conv_dim: int
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int


def linear_layers(model: Any) -> list[LinearLayerShape]:
    """The linear-attention layers of ``model`` (empty for an all-attention model)."""
    types = layer_types(model.config)
    out = []
    for i, kind in enumerate(types):
        if kind != LINEAR_ATTENTION:
            continue
        gdn = model.model.layers[i].linear_attn
        out.append(LinearLayerShape(i, gdn.conv_dim, gdn.conv_kernel_size, gdn.num_v_heads, gdn.head_k_dim,
                                    gdn.head_v_dim))
    return out


def slot_bytes(layers: list[LinearLayerShape], dtype: torch.dtype) -> int:
    """Bytes one row's state takes over all linear layers."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(s.conv_dim * s.conv_kernel * item + s.value_heads * s.key_dim * s.value_dim * 4 for s in layers)


class LinearStatePool:
    """``slots`` rows' worth of conv and recurrent state for every linear layer."""

    def __init__(self, layers: list[LinearLayerShape], slots: int, *, device: Any, dtype: torch.dtype):
        if not layers or slots < 1:
            raise ValueError("a linear state pool needs at least one linear layer and one slot")
        self.slots = slots
        self.slot_nbytes = slot_bytes(layers, dtype)
        self._index = {s.layer: i for i, s in enumerate(layers)}
        # torch.empty: on the CPU pages are committed on first write, so memory follows the slots in use
        self.conv = [torch.empty((slots, s.conv_dim, s.conv_kernel), device=device, dtype=dtype) for s in layers]
        self.recurrent = [torch.empty((slots, s.value_heads, s.key_dim, s.value_dim), device=device,
                                      dtype=torch.float32) for s in layers]
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    def index(self, layer: int) -> int:
        return self._index[layer]

    def allocate(self) -> int | None:
        """A slot for one row, or ``None`` when all are in use. Its contents are undefined until the
        row's first (``fresh``) forward writes them."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"linear state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def used(self) -> int:
        return len(self._used)

    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    def stats(self) -> dict[str, int]:
        return {"linear_state_slots_total": self.slots, "linear_state_slots_used": self.used(),
                "linear_state_slot_bytes": self.slot_nbytes, "linear_state_bytes": self.nbytes()}

    def step(self, attention: Any, slots: list[int], *, fresh: bool) -> "LinearStepState":
        return LinearStepState(self, attention, torch.tensor(slots, dtype=torch.long, device=self.conv[0].device),
                               fresh)


class LinearStepState:
    """``past_key_values`` for one hybrid forward: full-attention layers go to the paged step cache
    ``attention``; linear layers read and write the rows' ``slots`` of the pool (module docstring)."""

    is_compileable = False

    def __init__(self, pool: LinearStatePool, attention: Any, slots: torch.Tensor, fresh: bool):
        self.pool = pool
        self.attention = attention
        self.slots = slots
        self.fresh = fresh
        self._gathered: dict[int, torch.Tensor] = {}  # conv windows handed out for an in-place decode update

    # -- full-attention layers: the paged KV cache ------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.attention.update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.attention.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.attention.get_mask_sizes(query_length, layer_idx)

    # -- linear-attention layers: the rows' state slots --------------------------------
    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh:
            return None
        window = self.pool.conv[self.pool.index(layer_idx)].index_select(0, self.slots)
        self._gathered[layer_idx] = window  # a one-token step updates it in place: commit() writes it back
        return window

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """The inputs the convolution needs (the stored window, then this chunk's ``[rows, conv_dim,
        tokens]``); the last ``conv_kernel`` of them become the rows' new window."""
        i = self.pool.index(layer_idx)
        store = self.pool.conv[i]
        kernel = store.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < kernel:  # as transformers pads a prefill shorter than the kernel
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            window = self._gathered.pop(layer_idx, None)
            if window is None:
                window = store.index_select(0, self.slots)
            full = torch.cat([window, conv_states], dim=-1)
        store.index_copy_(0, self.slots, full[..., -kernel:].to(store.dtype))
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh:
            return None
        return self.pool.recurrent[self.pool.index(layer_idx)].index_select(0, self.slots)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        store = self.pool.recurrent[self.pool.index(layer_idx)]
        store.index_copy_(0, self.slots, recurrent_states.to(store.dtype))
        return recurrent_states

    def commit(self) -> None:
        """Write back the conv windows a one-token step updated in place."""
        for layer_idx, window in self._gathered.items():
            self.pool.conv[self.pool.index(layer_idx)].index_copy_(0, self.slots, window)
        self._gathered.clear()


SNAPSHOT_EVERY = 64  # tokens between state snapshots (the chunked prefill's block; rounded up to whole KV blocks)
SNAPSHOTS_PER_SLOT = 4  # snapshots kept per state slot of the pool (each costs one slot's bytes)

Snapshot = list[tuple[torch.Tensor, torch.Tensor]]  # per linear layer in order: (conv window, recurrent state)


class LinearSnapshots:
    """Snapshots of rows' linear state at block-aligned prompt prefixes (module docstring)."""

    def __init__(self, pool: LinearStatePool, block_size: int, *, per_slot: int = SNAPSHOTS_PER_SLOT):
        self.pool = pool
        self.every = math.lcm(SNAPSHOT_EVERY, block_size)
        self.capacity = per_slot * pool.slots
        self._store: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self.hits = 0
        self.evictions = 0

    def _digests(self, key: str, tokens: Sequence[int], upto: int) -> dict[int, bytes]:
        """The identity of each prefix ``tokens[:p]`` for ``p`` a multiple of ``every`` up to ``upto``."""
        h = hashlib.sha256(key.encode() + b"\0")
        out = {}
        for p in range(self.every, upto + 1, self.every):
            h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[p - self.every:p]))
            out[p] = h.copy().digest()
        return out

    def put(self, key: str, tokens: Sequence[int], captured: dict[int, Snapshot]) -> None:
        """Keep ``captured`` (position -> snapshot) of a row whose adapter key is ``key`` and prompt ``tokens``."""
        if not captured:
            return
        digests = self._digests(key, tokens, max(captured))
        for pos, snap in captured.items():
            d = digests[pos]
            self._store[d] = snap
            self._store.move_to_end(d)
        while len(self._store) > self.capacity:
            self._store.popitem(last=False)
            self.evictions += 1

    def limit(self, key: str, tokens: Sequence[int], limit: int) -> int:
        """The longest prefix of ``tokens[:limit]`` with a snapshot (0: none)."""
        digests = self._digests(key, tokens, limit)
        return next((p for p in sorted(digests, reverse=True) if digests[p] in self._store), 0)

    def restore(self, key: str, tokens: Sequence[int], pos: int, slot: int) -> None:
        """Copy the snapshot of ``tokens[:pos]`` into ``slot`` (a row resuming its prompt at ``pos``)."""
        d = self._digests(key, tokens, pos)[pos]
        snap = self._store[d]
        self._store.move_to_end(d)
        for i, (conv, state) in enumerate(snap):
            self.pool.conv[i][slot].copy_(conv)
            self.pool.recurrent[i][slot].copy_(state)
        self.hits += 1

    def stats(self) -> dict[str, int]:
        return {"linear_snapshots": len(self._store), "linear_snapshots_max": self.capacity,
                "linear_snapshot_hits": self.hits, "linear_snapshot_evictions": self.evictions}
