"""The three batch builders of an engine cycle: each turns rows into one model forward.

* :meth:`Batches.packed` - decode tokens and prompt chunks of all rows as ONE sequence
  ``[1, T]`` with a mask that confines every token to its own row's blocks (no padding
  of the queries);
* :meth:`Batches.decode` - one token for each decoding row;
* :meth:`Batches.prefill` - the next prompt chunk of each row, right-padded; with
  ``all_logits=True`` it keeps every position's logits (scoring rows).

Rows are the scheduler's (duck-typed: ``tokens`` (what to prefill), ``prefilled``,
``pos``, ``blocks``, ``generated``, ``adapter_key``); every row already holds the
blocks its positions of this step need (the scheduler allocates them). The builders
read rows and never change them: a row's ``pos`` and ``prefilled`` advance in the
cycle's update (:mod:`kiln.runtime.cycle_update`), after the forward returned, so a
forward that raises leaves every row as it was before the cycle. KV lives in a
:class:`~kiln.runtime.paged_kv.BlockPool`; attention reads each row's own blocks,
``len(blocks) * block_size`` positions wide, masked to its length. Every tensor is
created on the model's device. The caller holds shared accelerator ownership and
inference mode.

Hybrid models (``states``: a :class:`~kiln.runtime.linear_state.LinearStatePool`; each row
also has a ``state_slot``) run the lean hybrid forward (kiln.runtime.lean_hybrid, CPU) when it
supports the model and the rows' adapters: every generation cycle, decode tokens and prompt
chunks of any lengths and adapters, is one packed forward over variable-length rows. Otherwise
(scoring rows, other devices, ``lean_forward = false``, unsupported adapters) they run
transformers' forward (its Gated DeltaNet functions as kiln.runtime.linear_kernels chose them:
package kernels for CUDA tensors, else the torch reference) with the paged cache wrapped in a
:class:`~kiln.runtime.linear_state.LinearStepState`: decode steps batch every row as usual; the
chunks that start a row's state go left-padded into one forward (the linear layers zero the
padding's inputs, and zero inputs before an empty state leave it empty), the others one forward
per chunk length (the recurrence would run over padding after a state). Both paths keep the
state in the same pool layout, so a row may cross between them. The attention models' lean
forward and compiled decode are not used for hybrids.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from kiln.runtime import gated_deltanet
from kiln.runtime.lean_forward import lean_forward_for
from kiln.runtime.lean_hybrid import batch_of, lean_hybrid_for
from kiln.runtime.linear_state import LinearSnapshots, LinearStatePool
from kiln.runtime.paged_kv import SCRATCH, BlockPool

log = logging.getLogger(__name__)

# A packed forward's attention spans every row's keys: tokens x rows x kv_len scores, each costing
# heads x head_dim multiply-adds. Above this many per layer a mixed cycle uses two forwards (decode,
# then prefill). 2^21 scores at the built-in model's 4 x 32 query channels, measured there; on the
# 31M Qwen3 shape (8 x 64) the unscaled limit let 500-token mixed steps over 27 rows take 250-530 ms
# (docs/benchmarks.md).
PACKED_MAX_SCORES = 1 << 21
PACKED_SCORE_CHANNELS = 128  # query channels (heads x head_dim) PACKED_MAX_SCORES was measured at

Chunk = tuple[Any, int]  # (row, prompt tokens this cycle)


def _lean_hybrid(model: Any, states: LinearStatePool | None, kernel: Any, lean: bool, packed_weights: bool) -> Any:
    """The lean hybrid forward for a hybrid's batches (CPU: its state kernels), else None."""
    if states is None or not lean or model is None or states.conv[0].device.type != "cpu":
        return None
    return lean_hybrid_for(model, pack=packed_weights, kernel=kernel, gdn_kernel=gated_deltanet.load())


def bucket(n: int, cap: int) -> int:
    """The next power of two >= ``n``, at most ``cap`` (a static shape for the compiled decode)."""
    return min(cap, 1 << max(0, n - 1).bit_length())


class Batches:
    def __init__(self, kv: BlockPool, adapters: Any, device: Any, pad_id: int, *, compile_decode: bool = False,
                 max_rows: int = 1, max_blocks: int = 1, model: Any = None, lean: bool = True,
                 packed_weights: bool = False, paged_attention: Any = None, states: LinearStatePool | None = None):
        self.kv = kv
        self.adapters = adapters
        self.states = states
        # a hybrid's own lean forward (kiln.runtime.lean_hybrid): packed variable-length rows, fused state steps
        self.hybrid = _lean_hybrid(model, states, paged_attention, lean, packed_weights)
        # the hybrid half of the prefix cache: state snapshots the lean hybrid forward takes (None: no cache)
        self.snapshots = LinearSnapshots(states, kv.block_size) if self.hybrid is not None and kv.prefix_cache \
            else None
        if states is not None:  # those paths implement attention layers only
            lean = compile_decode = False
        # the same math as the model's forward with far less Python per step (bitwise equal logits);
        # used for batches whose rows run without an adapter or with plain LoRA ones (kiln.runtime.lean_forward)
        self.lean = lean_forward_for(model, pack=packed_weights) if lean and model is not None else None
        # reads the pool's blocks in place (kiln.runtime.paged_attention) in the lean forward's
        # decode and packed steps; None: gather + SDPA
        self.paged_attention = paged_attention if self.lean is not None else None
        self.device = device
        self.pad_id = pad_id
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        # torch.compile over static shapes: rows padded to a power-of-two bucket, block tables to
        # a power-of-two width; one compilation per (rows, width) bucket, on first use.
        self._compiled = torch.compile(self._decode_forward, dynamic=False) if compile_decode else None
        self.compiled_shapes: set[tuple[int, int]] = set()
        # why the compiled decode was turned off (a bucket failed to compile: the engine runs eager instead)
        self.compile_error: str | None = None

    def _forward(self, keys: Sequence[str], ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: Any,
                 keep: int | torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of one forward; ``keys`` are the adapter keys of the batch rows (PEFT's ``adapter_names``).
        ``padding``: a hybrid's left-padded fresh chunks, ``[rows, width]`` 1 for real tokens (the linear
        layers zero the others' inputs)."""
        if self._lean_runs(keys):
            return self.lean(ids, pos, mask, cache, keep, keys)
        extra = {"adapter_names": list(keys)} if self.adapters.wrapped else {}
        if self.states is not None:  # per layer type (see Batches.prefill)
            mask = {"full_attention": mask, "linear_attention": padding}
        logits = self.adapters.forward_model(input_ids=ids, position_ids=pos, attention_mask=mask,
                                             past_key_values=cache, use_cache=True, logits_to_keep=keep,
                                             **extra).logits
        if self.states is not None:
            cache.commit()
        return logits

    def _lean_runs(self, keys: Sequence[str]) -> bool:
        """Whether the lean forward runs a batch with these adapter keys (none, or plain LoRA adapters)."""
        if self.lean is None:
            return False
        wrapped = self.adapters is not None and self.adapters.wrapped
        return self.lean.runs(keys, self.adapters.forward_model.peft_config if wrapped else None)

    def _step(self, rows: list[Any], table: torch.Tensor, wb: torch.Tensor | None, wo: torch.Tensor | None,
              **kw: Any) -> Any:
        """The step cache of one forward over ``rows``: paged KV, plus the rows' linear state for a hybrid."""
        cache = self.kv.step(table, wb, wo, **kw)
        if self.states is None:
            return cache
        return self.states.step(cache, [r.state_slot for r in rows], fresh=rows[0].prefilled == 0)

    def _where(self, table: torch.Tensor, row: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of cache position ``pos`` of table row ``row``."""
        bs = self.kv.block_size
        return table[row, pos // bs], pos % bs

    def _hybrid_runs(self, rows: Sequence[Any]) -> bool:
        """Whether the lean hybrid forward runs these rows (their adapters are ones it supports)."""
        if self.hybrid is None:
            return False
        wrapped = self.adapters is not None and self.adapters.wrapped
        return self.hybrid.runs([r.adapter_key for r in rows], self.adapters.forward_model.peft_config
                                if wrapped else None)

    def _hybrid_cycle(self, decoding: list[Any], chunks: list[Chunk]) -> tuple[torch.Tensor | None,
                                                                                torch.Tensor | None, list[Any]]:
        """:meth:`packed` on the lean hybrid forward: any mix of rows, lengths and adapters in one forward."""
        snaps = self.snapshots
        batch, completing = batch_of(decoding, chunks, self.kv, self.device, snaps.every if snaps else 0)
        logits = self.hybrid.forward_batch(batch, self.kv, self.states)
        if snaps is not None:
            for i, (r, _) in enumerate(chunks):
                key = getattr(r, "cache_key", None)
                if key is not None and len(decoding) + i in batch.captured:
                    snaps.put(key, r.tokens, batch.captured[len(decoding) + i])
        n = len(decoding)
        return (logits[:n] if n else None), (logits[n:] if completing else None), completing

    def _in_place(self, rows: list[Any]) -> Any:
        """The in-place attention kernel when the lean forward will run these rows, else None."""
        if self.paged_attention is not None and self._lean_runs([r.adapter_key for r in rows]):
            return self.paged_attention
        return None

    def packable(self, decoding: list[Any], chunks: list[Chunk]) -> bool:
        """One packed forward if every row uses the same adapter and the attention stays small
        (in place, each token reads only its own row's positions: always small enough)."""
        rows = decoding + [r for r, _ in chunks]
        if self.states is not None:
            return self._hybrid_runs(rows)
        if len({r.adapter_key for r in rows}) != 1:
            return False  # a hybrid's recurrence runs per row; PEFT picks adapters per batch row
        if self._in_place(rows) is not None:
            return True
        tokens = len(decoding) + sum(c for _, c in chunks)
        kv_len = max(len(r.blocks) for r in rows) * self.kv.block_size
        return tokens * len(rows) * kv_len * self.kv.shape.query_channels <= PACKED_MAX_SCORES * PACKED_SCORE_CHANNELS

    def packed(self, decoding: list[Any], chunks: list[Chunk]) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Any]]:
        """Returns decode logits ``[len(decoding), vocab]`` (or ``None``), logits ``[m, vocab]``
        at the last prompt token of the ``m`` rows whose prefill completes, and those rows."""
        if self.states is not None:
            return self._hybrid_cycle(decoding, chunks)
        dev = self.device
        ids: list[int] = []
        row_of: list[int] = []
        pos_of: list[int] = []
        keep: list[int] = []
        for i, r in enumerate(decoding):
            ids.append(r.generated[-1])
            row_of.append(i)
            pos_of.append(r.pos)
            keep.append(i)
        completing = []
        for j, (r, c) in enumerate(chunks):
            start = r.prefilled
            ids.extend(r.tokens[start : start + c])
            row_of.extend([len(decoding) + j] * c)
            pos_of.extend(range(start, start + c))
            if start + c == len(r.tokens):
                keep.append(len(ids) - 1)
                completing.append(r)
        rows = decoding + [r for r, _ in chunks]
        table = self.kv.table([r.blocks for r in rows])
        kv_len = table.shape[1] * self.kv.block_size
        row_t = torch.tensor(row_of, device=dev)
        pos_t = torch.tensor(pos_of, device=dev)
        kernel = self._in_place(rows) if len(rows) > 1 or not chunks else None  # one prompt alone: SDPA's GEMMs
        if kernel is not None:  # the kernel finds each token's slot from the table itself
            mask = None
            cache = self.kv.step(table, None, None, packed=True, in_place=(kernel, row_t, pos_t))
        else:
            wb, wo = self._where(table, row_t, pos_t)
            key_row = torch.arange(len(rows), device=dev).repeat_interleave(kv_len)
            key_pos = torch.arange(kv_len, device=dev).repeat(len(rows))
            mask = ((key_row[None, :] == row_t[:, None]) & (key_pos[None, :] <= pos_t[:, None]))[None, None]
            cache = self.kv.step(table, wb[None, :], wo[None, :], packed=True)
        logits = self._forward([rows[0].adapter_key], torch.tensor([ids], device=dev), pos_t[None, :], mask, cache,
                               torch.tensor(keep, dtype=torch.long, device=dev) if keep else 1)[0]
        n = len(decoding)
        return (logits[:n] if n else None), (logits[n:] if completing else None), completing

    def _decode_forward(self, ids, pos, mask, table, wb, wo) -> torch.Tensor:
        cache = self.kv.step(table, wb, wo)
        out = self.adapters.forward_model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                          use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def decode_compiled(self, rows: list[Any]) -> torch.Tensor:
        """:meth:`decode` through the compiled step: padding rows read and write only the scratch block."""
        dev = self.device
        n = len(rows)
        rows_b = bucket(n, self.max_rows)
        width = bucket(max(len(r.blocks) for r in rows), self.max_blocks)
        table = self.kv.table([r.blocks for r in rows] + [[]] * (rows_b - n), width)
        pos = torch.tensor([r.pos for r in rows] + [0] * (rows_b - n), device=dev)
        ids = torch.tensor([[r.generated[-1]] for r in rows] + [[self.pad_id]] * (rows_b - n), device=dev)
        wb, wo = self._where(table, torch.arange(rows_b, device=dev), pos)
        mask = (torch.arange(width * self.kv.block_size, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        if (rows_b, width) in self.compiled_shapes:
            logits = self._compiled(ids, pos[:, None], mask, table, wb[:, None], wo[:, None])
        else:  # first use of this bucket compiles it; a compiler failure turns the option off, not the engine
            try:
                logits = self._compiled(ids, pos[:, None], mask, table, wb[:, None], wo[:, None])
            except Exception as exc:  # noqa: BLE001  (inductor raises its own C++/backend error types)
                return self._compile_failed(rows, exc)
            self.compiled_shapes.add((rows_b, width))
        return logits[:n]

    @property
    def compiles(self) -> bool:
        """Whether decode cycles use the compiled step (configured, and no bucket failed to compile)."""
        return self._compiled is not None

    def _compile_failed(self, rows: list[Any], exc: BaseException) -> torch.Tensor:
        """Turns the compiled decode off after a bucket failed to compile and runs ``rows`` eagerly.
        Positions are not advanced yet, and a partial run (a graph break before the failing piece) wrote
        only this cycle's KV slots, which the eager decode writes again with the same values."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.compile_error = f"{type(exc).__name__}: {first}"[:500]
        self._compiled = None
        log.warning("batching.compile_decode is off: compiling the decode step failed (%s); decoding eagerly",
                    self.compile_error)
        return self.decode(rows)

    def decode(self, rows: list[Any]) -> torch.Tensor:
        """One token for each decoding row -> logits ``[n, vocab]`` (compiled when enabled and no
        adapter is loaded: PEFT's per-row adapter routing stays eager)."""
        if self._compiled is not None and not self.adapters.wrapped:
            return self.decode_compiled(rows)
        if self._hybrid_runs(rows):
            return self._hybrid_cycle(rows, [])[0]
        dev = self.device
        n = len(rows)
        pos = torch.tensor([r.pos for r in rows], device=dev)
        table = self.kv.table([r.blocks for r in rows])
        kv_len = table.shape[1] * self.kv.block_size
        ids = torch.tensor([[r.generated[-1]] for r in rows], device=dev)
        row = torch.arange(n, device=dev)
        kernel = self._in_place(rows)
        if kernel is not None:  # the kernel finds each token's slot from the table itself
            mask = None
            cache = self.kv.step(table, None, None, in_place=(kernel, row, pos))
        else:
            wb, wo = self._where(table, row, pos)
            mask = (torch.arange(kv_len, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
            cache = self._step(rows, table, wb[:, None], wo[:, None])
        logits = self._forward([r.adapter_key for r in rows], ids, pos[:, None], mask, cache, 1)
        return logits[:, -1]

    def prefill(self, chunks: list[Chunk], *, all_logits: bool = False) -> tuple[torch.Tensor | None, list[Any]]:
        """Next prompt chunk of each row, right-padded into one forward. A hybrid's chunks that start a
        row's state go left-padded into one forward (padding before an empty state leaves it empty:
        the linear layers see zero inputs there); the others, one forward per chunk length.

        Default: logits ``[m, vocab]`` at the last prompt token of the ``m`` rows whose
        prefill completes in this chunk, and those rows (in the same order). ``all_logits``:
        logits ``[rows, width, vocab]`` for every chunk position (row ``i``'s first
        ``c_i`` are real), and all the rows.
        """
        if self.states is None:
            return self._prefill(chunks, all_logits)
        if not all_logits and self._hybrid_runs([r for r, _ in chunks]):
            _, logits, completing = self._hybrid_cycle([], chunks)
            return logits, completing
        groups: dict[tuple[int, bool], list[Chunk]] = {}
        for r, c in chunks:  # scoring (all_logits) keeps every chunk right-aligned: grouped by length too
            fresh = r.prefilled == 0
            groups.setdefault((0 if fresh and not all_logits else c, fresh), []).append((r, c))
        results = [self._prefill(g, all_logits, left=fresh and not all_logits) for (_, fresh), g in groups.items()]
        if len(results) == 1:
            return results[0]
        if not all_logits:
            parts = [(lg, rows) for lg, rows in results if lg is not None]
            if not parts:
                return None, []
            return torch.cat([lg for lg, _ in parts]), [r for _, rows in parts for r in rows]
        first = results[0][0]
        out = first.new_zeros((len(chunks), max(c for _, c in chunks), first.shape[-1]))
        at = {id(r): i for i, (r, _) in enumerate(chunks)}
        for lg, rows in results:
            index = torch.tensor([at[id(r)] for r in rows], device=out.device)
            out[index, :lg.shape[1]] = lg
        return out, [r for r, _ in chunks]

    def _prefill(self, chunks: list[Chunk], all_logits: bool, *, left: bool = False
                 ) -> tuple[torch.Tensor | None, list[Any]]:
        """One forward over ``chunks``, right-padded (``left``: left-padded, the last column real in every row)."""
        dev = self.device
        rows = [r for r, _ in chunks]
        width = max(c for _, c in chunks)
        starts = torch.tensor([r.prefilled for r in rows], device=dev)
        lens = torch.tensor([c for _, c in chunks], device=dev)
        col = torch.arange(width, device=dev)[None, :]
        at = col - (width - lens[:, None]) if left else col  # each column's index in its row's chunk
        qpos = starts[:, None] + at.clamp(min=0).minimum(lens[:, None] - 1)
        real = (at >= 0) & (at < lens[:, None])
        table = self.kv.table([r.blocks for r in rows])
        kv_len = table.shape[1] * self.kv.block_size
        wb, wo = self._where(table, torch.arange(len(rows), device=dev)[:, None], qpos)
        wb = torch.where(real, wb, torch.full_like(wb, SCRATCH))
        wo = torch.where(real, wo, torch.zeros_like(wo))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=dev)
        for i, (r, c) in enumerate(chunks):
            (ids[i, width - c:] if left else ids[i, :c]).copy_(
                torch.tensor(r.tokens[r.prefilled : r.prefilled + c], device=dev))
        mask = (torch.arange(kv_len, device=dev)[None, None, :] <= qpos[:, :, None])[:, None]
        cache = self._step(rows, table, wb, wo)
        keep = 0 if all_logits else 1 if left else (lens - 1)[:, None]
        padding = real.long() if left and width > int(lens.min()) else None
        logits = self._forward([r.adapter_key for r in rows], ids, qpos, mask, cache, keep, padding)
        completing_idx = [i for i, (r, c) in enumerate(chunks) if r.prefilled + c == len(r.tokens)]
        if all_logits:
            return logits, rows
        if not completing_idx:
            return None, []
        logits = logits[:, -1]
        return logits[torch.tensor(completing_idx, device=dev)], [rows[i] for i in completing_idx]
