"""Preallocated per-row KV cache for the batching engine.

Every running row owns one *slot*: ``keys[layer][slot]`` holds its keys for
positions ``0 .. capacity-1`` (shape ``[kv_heads, capacity, head_dim]``). One
forward step serves a set of slots at once; :class:`StepCache` is the object the
Hugging Face model receives as ``past_key_values`` for that step: its
``update(k, v, layer_idx)`` scatters the new keys/values at each row's own
positions and returns the keys/values the attention reads (batch order = the
step's slot order). Column ``capacity`` is a scratch column that padded query
positions write to; it is never attended.

The engine keeps decoding rows in slots ``0 .. n-1`` so a decode step reads a
plain view (no gather copy); :meth:`SlotKV.move` relocates a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int


def cache_shape(config) -> CacheShape:
    """KV geometry of a Hugging Face decoder config (text config for multimodal ones)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    return CacheShape(
        layers=cfg.num_hidden_layers,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    )


class SlotKV:
    """``rows`` slots of ``capacity`` positions for every layer."""

    def __init__(self, shape: CacheShape, rows: int, capacity: int, *, device: str, dtype: torch.dtype):
        self.shape = shape
        self.rows = rows
        self.capacity = capacity
        dims = (rows, shape.kv_heads, capacity + 1, shape.head_dim)  # +1: scratch column
        self.keys = [torch.zeros(dims, device=device, dtype=dtype) for _ in range(shape.layers)]
        self.values = [torch.zeros(dims, device=device, dtype=dtype) for _ in range(shape.layers)]
        self.device = device

    @property
    def scratch(self) -> int:
        return self.capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length <= 0:
            return
        for k, v in zip(self.keys, self.values):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def step(self, slots: list[int], write_pos: torch.Tensor, kv_len: int) -> "StepCache":
        """A cache view for one forward over ``slots`` (batch order).

        ``write_pos``: ``[batch, q_len]`` cache positions the step's tokens go to
        (the scratch column for padding); ``kv_len``: how many positions attention reads.
        """
        return StepCache(self, slots, write_pos, kv_len)

    def packed_step(self, slots: list[int], token_row: torch.Tensor, token_pos: torch.Tensor,
                    kv_len: int) -> "PackedStepCache":
        """A cache view for one forward over tokens of several rows packed into a batch of one.

        ``token_row[t]`` is the index into ``slots`` of the row token ``t`` belongs to and
        ``token_pos[t]`` its cache position; attention reads ``kv_len`` positions of
        every listed row, flattened row-major (the mask must keep each token to its row).
        """
        return PackedStepCache(self, slots, token_row, token_pos, kv_len)


class StepCache:
    """Duck-typed ``past_key_values`` for one forward (only ``update`` is used by the model)."""

    is_compileable = False

    def __init__(self, kv: SlotKV, slots: list[int], write_pos: torch.Tensor, kv_len: int):
        self.kv = kv
        n = len(slots)
        first = slots[0]
        self._contiguous = slots == list(range(first, first + n))
        if self._contiguous:
            self._lo, self._hi = first, first + n
            self._rows = torch.arange(n, device=kv.device)
        else:
            self._rows = torch.tensor(slots, device=kv.device)
        self._write_pos = write_pos
        self._kv_len = kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [batch, kv_heads, q_len, head_dim]
        kc, vc = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        if self._contiguous:
            kc, vc = kc[self._lo:self._hi], vc[self._lo:self._hi]
        rows = self._rows[:, None]
        kc[rows, :, self._write_pos] = key_states.transpose(1, 2).to(kc.dtype)
        vc[rows, :, self._write_pos] = value_states.transpose(1, 2).to(vc.dtype)
        if self._contiguous:
            return kc[:, :, : self._kv_len], vc[:, :, : self._kv_len]
        return kc[self._rows, :, : self._kv_len], vc[self._rows, :, : self._kv_len]

    # Methods some model code paths query; answers describe this step only.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self._kv_len, 0


class PackedStepCache:
    """``past_key_values`` for a packed forward: queries ``[1, T]`` from several rows.

    Keys/values come back as ``[1, kv_heads, rows * kv_len, head_dim]`` (row-major),
    so one attention call serves decode tokens and prompt chunks of different rows
    together without padding; the caller's mask confines each query to its own row.
    """

    is_compileable = False

    def __init__(self, kv: SlotKV, slots: list[int], token_row: torch.Tensor, token_pos: torch.Tensor,
                 kv_len: int):
        self.kv = kv
        self._slots = torch.tensor(slots, device=kv.device)
        self._token_slot = self._slots[token_row]
        self._token_pos = token_pos
        self._kv_len = kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [1, kv_heads, T, head_dim]
        kc, vc = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        kc[self._token_slot, :, self._token_pos] = key_states[0].transpose(0, 1).to(kc.dtype)
        vc[self._token_slot, :, self._token_pos] = value_states[0].transpose(0, 1).to(vc.dtype)
        k = kc[self._slots, :, : self._kv_len]  # [rows, kv_heads, kv_len, head_dim]
        v = vc[self._slots, :, : self._kv_len]
        heads, dim = k.shape[1], k.shape[3]
        return (k.transpose(0, 1).reshape(1, heads, -1, dim), v.transpose(0, 1).reshape(1, heads, -1, dim))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len
