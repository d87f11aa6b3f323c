"""Every row's KV bookkeeping in one place: which blocks of the :class:`~kiln.runtime.paged_kv.BlockPool`
a row holds, which of them it has offered to the prefix cache, and (hybrid models) its linear-state slot.

The pool only hands out and takes back blocks; :class:`BlockLedger` is the one writer of a row's
``blocks``, ``cache_uid``, ``registered`` and ``state_slot``: admission (prefix match, room for the
prompt, a state slot), growth before a step writes past the table, publication of completed prompt
blocks, and release (finish, cancel, preemption, engine stop). The scheduler asks it; the batch
builders only read what it wrote.
"""

from __future__ import annotations

from kiln.runtime.linear_state import LinearSnapshots, LinearStatePool
from kiln.runtime.paged_kv import BlockPool
from kiln.runtime.rows import Row, ScoreRow


class BlockLedger:
    """Block tables and linear-state slots of the scheduler's rows (see the module docstring)."""

    def __init__(self, kv: BlockPool, states: LinearStatePool | None, snapshots: LinearSnapshots | None = None):
        self.kv = kv
        self.states = states
        self.snapshots = snapshots  # a hybrid's prefix cache: the linear state at cached prefix ends

    def reserve(self, row: Row | ScoreRow, others_running: bool) -> bool:
        """Attach ``row``'s cached prefix blocks and its state slot if the pool can hold its prompt
        (or nothing else runs: a lone row always starts); ``False`` leaves the row holding nothing.

        A generation row reuses cached blocks up to its last prompt token; a scoring row keeps every
        position's logits, so it computes them all, unless it asks for rows from ``score_from`` on
        only (logits from ``score_from - 1``). On success ``prefilled`` and ``pos`` start after the
        cached blocks; a hybrid's row starts from the state snapshot at their end."""
        kv = self.kv
        if not isinstance(row, ScoreRow):
            row.blocks, row.cache_uid = self._match(row, len(row.tokens) - 1)
            row.registered = len(row.blocks)
        elif row.score_from > 1:
            row.blocks, row.cache_uid = self._match(row, row.score_from - 1)
            row.registered = len(row.blocks)
        need = kv.blocks_for(len(row.tokens)) - len(row.blocks)
        states = self.states
        slot = None if need > kv.available() and others_running else states.allocate() if states else -1
        if slot is None:
            kv.release(row.blocks)  # wait for memory (or a state slot); rows running now will free theirs
            row.blocks = []
            return False
        row.state_slot = slot
        row.prefilled = row.pos = len(row.blocks) * kv.block_size
        if row.blocks and self.snapshots is not None:
            self.snapshots.restore(row.cache_key, row.tokens, row.prefilled, slot)
        return True

    def _match(self, row: Row | ScoreRow, limit: int) -> tuple[list[int], int]:
        """Cached prefix blocks for ``row`` (``BlockPool.match``); a hybrid's end where a linear-state
        snapshot does (kiln.runtime.linear_state.LinearSnapshots), or it takes none."""
        kv, snaps = self.kv, self.snapshots
        if snaps is None:
            return kv.match(row.cache_key, row.tokens, limit)
        while (limit := snaps.limit(row.cache_key, row.tokens, limit)) > 0:
            blocks, uid = kv.match(row.cache_key, row.tokens, limit)
            if len(blocks) * kv.block_size == limit:
                return blocks, uid
            kv.release(blocks)  # fewer blocks cached than the snapshot covers: a shorter prefix
            kv.hits -= len(blocks)
            limit = len(blocks) * kv.block_size
        return [], 0

    def grow(self, row: Row | ScoreRow, positions: int) -> bool:
        """Blocks for ``row``'s first ``positions`` positions; ``False`` when the pool ran out."""
        for _ in range(self.kv.blocks_for(positions) - len(row.blocks)):
            block = self.kv.allocate()
            if block is None:
                return False
            row.blocks.append(block)
        return True

    def blocks_room(self, row: Row | ScoreRow) -> int:
        """Positions ``row``'s table holds past its prefill (what a prompt chunk may fill)."""
        return len(row.blocks) * self.kv.block_size - row.prefilled

    def release(self, row: Row | ScoreRow) -> None:
        """Give back ``row``'s blocks (full prompt blocks stay in the prefix cache) and its state slot."""
        self.kv.release(row.blocks)
        row.blocks = []
        if row.state_slot >= 0 and self.states is not None:
            self.states.release(row.state_slot)
        row.state_slot = -1

    def forget_prefix(self, row: Row | ScoreRow) -> None:
        """A preempted row recomputes from scratch: nothing of it is published any more."""
        row.registered = 0
        row.cache_uid = 0

    def publish(self, row: Row | ScoreRow) -> None:
        """Offer ``row``'s newly completed prompt blocks to the prefix cache (a scoring row's only when it
        asked for rows from a position on: a full-prompt scoring computes every position anyway)."""
        if not self.kv.prefix_cache or (isinstance(row, ScoreRow) and row.score_from <= 1):
            return
        bs = self.kv.block_size
        while row.registered < row.prefilled // bs:
            i = row.registered
            row.cache_uid = self.kv.register(row.cache_key, row.cache_uid, tuple(row.tokens[i * bs:(i + 1) * bs]),
                                             row.blocks[i])
            row.registered += 1
