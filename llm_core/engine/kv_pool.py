"""The paged KV pool's bookkeeping: fixed-size blocks, a block table per sequence, reference counts, prefix keys
chained over full blocks, and an LRU of cached blocks nobody holds. Knows nothing of torch or of the cache tensors:
a runner maps block ids to rows of its own KV storage (block b holds positions b*block_size .. (b+1)*block_size-1
of that storage); this file only decides which ids a sequence owns.

The design follows vLLM's v1 block pool, smaller: a full block's key is sha256(parent key, its token ids, the
namespace) so one key names one whole prefix; blocks of a finished reply stay findable until the pool needs them,
and the least recently released unheld block is the first one re-used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llm_core.errors import LLMCoreError


class PoolExhausted(LLMCoreError):
    """Raised when a sequence asks for more blocks than are free or evictable; the scheduler waits and retries."""


def block_key(parent: bytes | None, tokens: Sequence[int], namespace: str) -> bytes:
    """The key of a full block: its tokens, chained to every block before it and to the model/KV format that wrote
    it, so equal keys mean an equal prefix from position 0 (sha256: a collision would reuse another prompt's KV)."""
    digest = hashlib.sha256()
    digest.update(parent or b"root")
    digest.update(namespace.encode())
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # set once the block is full and cached


@dataclass
class BlockTable:
    """One sequence's blocks in position order and how many of its tokens they hold."""

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    cached_tokens: int = 0  # the prompt tokens found in the pool when the sequence started

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """The storage row of a position: block id * block size + offset."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size


class BlockPool:
    """Blocks 0..num_blocks-1 of one KV storage.

    A block is in one of three states: held (reference count > 0, by one or more sequences that share a prefix),
    cached (count 0 but keyed: a later prompt with the same prefix can take it back), or free (count 0, no key).
    Unheld blocks wait in `_unheld`, oldest release first; allocation takes from there and forgets the key of a
    cached block it takes.
    """

    def __init__(self, num_blocks: int, block_size: int, *, namespace: str = "", caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.caching = caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._unheld: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_key: dict[bytes, int] = {}

    # --- what a scheduler asks -------------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks a new sequence can take now (free or cached but unheld)."""
        return len(self._unheld)

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by their prefix key (held or not)."""
        return len(self._by_key)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that `tokens` positions take (the last one may be partly filled)."""
        return -(-tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """Sequences holding this block now."""
        return self._blocks[block_id].ref_count

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks that hold the longest full-block prefix of token_ids (not taken yet)."""
        if not self.caching:
            return []
        found: list[int] = []
        parent: bytes | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = block_key(parent, token_ids[start:start + self.block_size], self.namespace)
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            found.append(block_id)
            parent = key
        return found

    # --- a sequence's life -----------------------------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int], reserve_tokens: int) -> BlockTable:
        """A table for a new sequence: the cached prefix of prompt_ids taken back, then fresh blocks up to
        reserve_tokens in all (prompt + the reply's budget). At least the last prompt token is always recomputed
        (its logits start the reply). Raises PoolExhausted, holding nothing, when the blocks cannot be had."""
        cached, needed, evictable = self._start_plan(prompt_ids, reserve_tokens)
        reserve_tokens = max(reserve_tokens, len(prompt_ids))
        if needed > evictable:
            raise PoolExhausted(f"the KV pool has {evictable} free blocks; this reply needs {needed} "
                                f"({reserve_tokens:,} tokens in blocks of {self.block_size})")
        self._hold(cached)
        table = BlockTable(self.block_size, list(cached), tokens=len(cached) * self.block_size)
        table.cached_tokens = table.tokens
        table.block_ids.extend(self._take(needed))
        return table

    def can_start(self, prompt_ids: Sequence[int], reserve_tokens: int) -> bool:
        """Whether start(prompt_ids, reserve_tokens) would get its blocks now (nothing taken)."""
        _, needed, evictable = self._start_plan(prompt_ids, reserve_tokens)
        return needed <= evictable

    def _start_plan(self, prompt_ids: Sequence[int], reserve_tokens: int) -> tuple[list[int], int, int]:
        """start's arithmetic: the cached prefix's blocks (at least the last prompt token is recomputed: its logits
        start the reply), the fresh blocks still needed, and the unheld blocks the prefix does not take back."""
        reserve_tokens = max(reserve_tokens, len(prompt_ids))
        cached = self.match(prompt_ids[:max(len(prompt_ids) - 1, 0)])
        needed = self.blocks_for(reserve_tokens) - len(cached)
        evictable = len(self._unheld) - sum(1 for b in cached if self._blocks[b].ref_count == 0)
        return cached, needed, evictable

    def grow(self, table: BlockTable, tokens: int) -> None:
        """Make room for `tokens` positions in all (a reply that runs past its reserve). Raises PoolExhausted."""
        needed = self.blocks_for(tokens) - len(table.block_ids)
        if needed > len(self._unheld):
            raise PoolExhausted(f"the KV pool has {len(self._unheld)} free blocks; {needed} more are needed")
        table.block_ids.extend(self._take(needed))

    def commit(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Record that the sequence's KV now holds token_ids (from position 0) and key its newly full blocks, so
        a later prompt can find them. A block already keyed by an identical earlier block stays unkeyed (the block
        table is append-only; the first copy stays the one found)."""
        table.tokens = len(token_ids)
        if not self.caching:
            return
        parent: bytes | None = None
        for index in range(len(token_ids) // self.block_size):
            block = self._blocks[table.block_ids[index]]
            if block.key is None:
                key = block_key(parent, token_ids[index * self.block_size:(index + 1) * self.block_size],
                                self.namespace)
                if key not in self._by_key:
                    block.key = key
                    self._by_key[key] = block.block_id
                parent = key
            else:
                parent = block.key

    def finish(self, table: BlockTable) -> None:
        """The sequence ended: drop its hold. Its keyed blocks stay findable; the tail is released first so it is
        evicted first (an old turn's first blocks are the ones the next turn needs)."""
        for block_id in reversed(table.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is None:
                    self._unheld[block_id] = None
                    self._unheld.move_to_end(block_id, last=False)  # free blocks before cached ones
                else:
                    self._unheld[block_id] = None
        table.block_ids.clear()
        table.tokens = 0

    def forget(self) -> None:
        """Drop every key (the weights or the KV format changed): nothing cached is findable any more."""
        for block in self._blocks:
            block.key = None
        self._by_key.clear()

    # --- internals -------------------------------------------------------------------------------------------------

    def _hold(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._unheld[block_id]
            block.ref_count += 1

    def _take(self, count: int) -> list[int]:
        taken = []
        for _ in range(count):
            block_id, _ = self._unheld.popitem(last=False)
            block = self._blocks[block_id]
            if block.key is not None:
                del self._by_key[block.key]
                block.key = None
            block.ref_count = 1
            taken.append(block_id)
        return taken
