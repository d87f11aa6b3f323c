"""Paged KV cache: a pool of fixed-size blocks, a block table per row, and a prefix cache.

Storage per layer is ``[num_blocks, block_size, kv_heads, head_dim]`` for keys and
for values. A row owns a list of block ids (its *block table*): position ``p`` of
the row lives in block ``table[p // block_size]`` at offset ``p % block_size``.
Block 0 is a scratch block: padded query positions write there and padded table
entries point there; attention never reads it unmasked.

Memory: on CPU the pool is ``torch.empty`` (pages are committed on first write) and
free blocks are handed out lowest id first, so resident KV memory follows the peak
number of blocks in use, not ``rows x max_model_len``. A block is zeroed the first
time it is handed out, so masked positions never hold NaN garbage.

Prefix cache: a full block whose tokens came from a prompt is registered under the
key ``(parent uid, adapter key, its tokens)``, where the parent uid names the cached
block before it (0 for the first), so a key identifies the whole prefix exactly
(no hashing, no collisions). Registered blocks are reference-counted; at zero
references they stay cached (evictable, least recently used first) until a fresh
block is needed. Uids are never reused, so children of an evicted block simply
become unreachable and age out.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Any

import torch

SCRATCH = 0


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    query_heads: int = 0  # attention heads of the queries (0: as many as kv_heads)
    # the model's full-attention layers, in order (None: all ``layers`` of them, layer i stored at i); a
    # hybrid's linear-attention layers keep no KV (kiln.runtime.linear_state)
    layer_ids: tuple[int, ...] | None = None

    @property
    def query_channels(self) -> int:
        """Query heads x head_dim: what one attention score costs in multiply-adds."""
        return (self.query_heads or self.kv_heads) * self.head_dim


def cache_shape(config) -> CacheShape:
    """KV geometry of a Hugging Face decoder config (text config for multimodal ones): blocks for its
    full-attention layers only."""
    from kiln.runtime.model_family import FULL_ATTENTION, layer_types, text_config

    cfg = text_config(config)
    heads = cfg.num_attention_heads
    types = layer_types(cfg)
    attention = tuple(i for i, t in enumerate(types) if t == FULL_ATTENTION)
    return CacheShape(
        layers=len(attention),
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        query_heads=heads,
        layer_ids=None if len(attention) == len(types) else attention,
    )


def block_bytes(shape: CacheShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.layers * block_size * shape.kv_heads * shape.head_dim * itemsize


class BlockPool:
    """``num_blocks`` blocks (block 0 = scratch) with reference counts and the prefix cache."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, *, device: Any, dtype: torch.dtype,
                 prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least one block besides the scratch block")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.prefix_cache = prefix_cache
        self.block_nbytes = block_bytes(shape, block_size, dtype)
        dims = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.keys = [torch.empty(dims, device=device, dtype=dtype) for _ in range(shape.layers)]
        self.values = [torch.empty(dims, device=device, dtype=dtype) for _ in range(shape.layers)]
        # model layer index -> storage index (identity unless some layers keep no KV)
        ids = shape.layer_ids if shape.layer_ids is not None else range(shape.layers)
        self.kv_layer = {layer: i for i, layer in enumerate(ids)}
        self._zero(SCRATCH)
        self._free: list[int] = list(range(1, num_blocks))  # a heap: lowest id first
        self._fresh = [True] * num_blocks  # never handed out yet (contents undefined)
        self._fresh[SCRATCH] = False
        self._refs = [0] * num_blocks
        self._by_key: dict[tuple, tuple[int, int]] = {}  # key -> (block, uid)
        self._key_of: dict[int, tuple] = {}  # block -> key
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, 0 refs
        self._next_uid = 1
        self.hits = 0  # cached blocks reused
        self.evictions = 0
        # one reusable output buffer each for the gathered keys and values of the layer being run
        # (layers run one after another): a fresh multi-MiB tensor per layer per step was a fresh
        # mmap for glibc's allocator, page-faulted on every write (docs/benchmarks.md)
        self._workspace: list[torch.Tensor | None] = [None, None]

    # -- accounting --------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks rows can use (the scratch block excluded)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks obtainable now: free plus cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    def used(self) -> int:
        return self.capacity - self.available()

    def cached(self) -> int:
        return len(self._key_of)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def workspace_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._workspace if t is not None)

    def release_workspace(self) -> None:
        """Free the gather buffers (the engine calls this when it goes idle)."""
        self._workspace = [None, None]

    def gather(self, which: int, layer: int, flat: torch.Tensor) -> torch.Tensor:
        """Blocks ``flat`` of layer ``layer``'s keys (``which`` 0) or values (1) as
        ``[len(flat), block_size, kv_heads, head_dim]``, written into the reusable buffer: valid
        until the next gather of the same kind."""
        src = (self.keys if which == 0 else self.values)[layer]
        if torch.compiler.is_compiling():  # the compiled decode step allocates its own
            return src.index_select(0, flat)
        need = flat.numel() * src[0].numel()
        buf = self._workspace[which]
        if buf is None or buf.numel() < need or buf.dtype != src.dtype:
            buf = self._workspace[which] = torch.empty(need, dtype=src.dtype, device=src.device)
        out = buf[:need].view(flat.numel(), *src.shape[1:])
        return torch.index_select(src, 0, flat, out=out)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- allocation --------------------------------------------------------------
    def _zero(self, block: int) -> None:
        for k, v in zip(self.keys, self.values):
            k[block].zero_()
            v[block].zero_()

    def allocate(self) -> int | None:
        """A block for one row (one reference), evicting the oldest unused cached block if needed."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self.evictions += 1
        else:
            return None
        if self._fresh[block]:
            self._zero(block)
            self._fresh[block] = False
        self._refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    heapq.heappush(self._free, b)

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._by_key[key]

    # -- prefix cache ----------------------------------------------------------------
    def match(self, adapter_key: str, tokens: list[int], limit: int) -> tuple[list[int], int]:
        """Cached blocks covering the longest cached prefix of ``tokens[:limit]`` (whole blocks),
        each now referenced by the caller, and the uid of the last one (0 if none)."""
        if not self.prefix_cache:
            return [], 0
        bs = self.block_size
        out: list[int] = []
        uid = 0
        for i in range(limit // bs):
            hit = self._by_key.get((uid, adapter_key, tuple(tokens[i * bs:(i + 1) * bs])))
            if hit is None:
                break
            block, uid = hit
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            out.append(block)
        self.hits += len(out)
        return out, uid

    def register(self, adapter_key: str, parent_uid: int, tokens: tuple[int, ...], block: int) -> int:
        """Publish ``block`` (full, holding ``tokens`` after the prefix ``parent_uid``); returns its uid
        (the existing entry's when an identical prefix is already cached)."""
        if not self.prefix_cache:
            return 0
        key = (parent_uid, adapter_key, tokens)
        hit = self._by_key.get(key)
        if hit is not None:
            return hit[1]
        if block in self._key_of:  # already published under another key: cannot happen for prompt blocks
            return self._by_key[self._key_of[block]][1]
        uid = self._next_uid
        self._next_uid += 1
        self._by_key[key] = (block, uid)
        self._key_of[block] = key
        return uid

    def stats(self) -> dict[str, int]:
        return {
            "kv_blocks_total": self.capacity,
            "kv_blocks_used": self.used(),
            "kv_blocks_cached": self.cached(),
            "kv_blocks_free": self.available(),
            "kv_block_size": self.block_size,
            "prefix_cache_hit_blocks": self.hits,
            "prefix_cache_evictions": self.evictions,
        }

    # -- forwards ------------------------------------------------------------------
    def table(self, rows: list[list[int]], width: int | None = None) -> torch.Tensor:
        """Block tables of ``rows`` as ``[n, width]`` (padded with the scratch block)."""
        width = width or max(len(r) for r in rows)
        return torch.tensor([r + [SCRATCH] * (width - len(r)) for r in rows], device=self.device, dtype=torch.long)

    def step(self, table: torch.Tensor, write_block: torch.Tensor | None, write_off: torch.Tensor | None, *,
             packed: bool = False, in_place: Any = None) -> "PagedStepCache":
        return PagedStepCache(self, table, write_block, write_off, packed, in_place)


class PagedStepCache:
    """Duck-typed ``past_key_values`` for one forward over block tables.

    ``update`` writes the step's keys/values at ``(write_block, write_off)`` (shape of the
    query ``[batch, q_len]``) and returns the rows' blocks gathered in table order:
    ``[n, kv_heads, width * block_size, head_dim]``, or with ``packed`` every row's
    gathered keys concatenated into ``[1, kv_heads, n * width * block_size, head_dim]``.
    Only the rows' own blocks are read (one gather copy per layer, into the pool's reusable
    buffers: the returned tensors are valid until the next layer's update); the caller's
    mask hides positions past each row's length.

    ``in_place``: ``(kernel, row_of, pos_of)`` - each query token's row in ``table`` and its
    position (``write_block``/``write_off`` may then be ``None``), for :meth:`attend`
    (kiln.runtime.paged_attention), which stores the step's keys and values and reads the
    blocks where they lie (no gather, no mask) in one call; a forward that uses it calls
    :meth:`attend` instead of :meth:`update`.
    """

    is_compileable = False

    def __init__(self, pool: BlockPool, table: torch.Tensor, write_block: torch.Tensor | None,
                 write_off: torch.Tensor | None, packed: bool, in_place: Any = None):
        self.pool = pool
        self.in_place = in_place
        self._table = table
        self._flat = table.reshape(-1)
        self._n = 1 if packed else table.shape[0]
        self._kv_len = table.numel() * pool.block_size // self._n
        self._wb = write_block
        self._wo = write_off

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
               **prepare: Any) -> torch.Tensor:
        """Store the step's keys and values ``k``/``v`` (``[tokens, kv_heads, head_dim]``) and attend
        with ``q`` (``[tokens, heads, head_dim]``; the tokens of ``in_place``) over layer
        ``layer_idx``'s blocks, in one kernel call -> ``[tokens, heads * head_dim]``. ``prepare``:
        the kernel's ``qk_norm``/``rope`` (applied to ``q`` and ``k`` first)."""
        kernel, row_of, pos_of = self.in_place
        layer_idx = self.pool.kv_layer[layer_idx]
        return kernel.attend(q, self.pool.keys[layer_idx], self.pool.values[layer_idx], self._table, row_of, pos_of,
                             scale, new_keys=k, new_values=v, **prepare)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [batch, kv_heads, q_len, head_dim]
        layer_idx = self.pool.kv_layer[layer_idx]
        kc, vc = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        kc[self._wb, self._wo] = key_states.transpose(1, 2).to(kc.dtype)
        vc[self._wb, self._wo] = value_states.transpose(1, 2).to(vc.dtype)
        heads, dim = kc.shape[2], kc.shape[3]
        k = self.pool.gather(0, layer_idx, self._flat).view(self._n, self._kv_len, heads, dim).transpose(1, 2)
        v = self.pool.gather(1, layer_idx, self._flat).view(self._n, self._kv_len, heads, dim).transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self._kv_len, 0
