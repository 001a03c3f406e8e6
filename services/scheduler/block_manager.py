"""Sans-IO paged-KV block manager: the scheduler's view of the worker's KV cache.

A pool of `num_blocks` physical blocks of `block_size` token slots, each with a ref count, plus
prefix caching over FULL, computed blocks. Every block is in exactly one state:

- free: on the free list, no content worth keeping;
- cached: ref 0 but registered in the prefix cache; kept in an LRU and evicted on demand;
- in use: ref > 0, held by one or more sequences.

Prefix cache keying. Why a hash chain rather than a radix tree: lookups are one O(1) dict probe
per block, a sequence's blocks stay a flat list of ids that maps 1:1 onto the worker's block
table, and any unreferenced block can be evicted on its own with no tree surgery. Rather than
chaining a 64-bit hash of the parent (where one collision, or a parent evicted and re-registered
with colliding content, silently serves another prefix's KV), each full block is keyed by
`(registration id of its parent's cache entry, tuple(its tokens))`. The dict compares keys
exactly, and registration ids are never reused, so a hit is exact by induction down the chain
and the children of an evicted entry simply become unreachable (and age out of the LRU). That
is rare: freeing tail-first makes parents outlive their children in the LRU; only children
chained off another seq's identical block (see cache_blocks) can be orphaned early.

Blocks are keyed when the step that computes them is planned, not when its result returns, so
identical prompts (the n choices of one request, or clients sending the same prompt) share a
prompt computed once. Steps run in plan order, so a later step may read a block keyed by an
earlier one; but the step being planned must not read a block that it computes itself. Blocks
keyed since `begin_step()` are "fresh": a lookup stops at one and says so, so the scheduler
can let that request wait one step and then take the block as a hit (docs/kv-cache.md).

KV events (docs/kv-events.md). With `record_events`, the manager keeps a log of what enters and
leaves the prefix cache, for routers that track each replica's cache: `BlocksStored` when full
blocks are keyed (a chain, named by their registration ids), `BlocksRemoved` when they are
evicted, `AllBlocksCleared` for a new pool or a reset. Registration ids serve as the published
block hashes: unique for the pool's life, so stored and removed events always pair up exactly.
Disabled, the only cost is one `is None` check where a block is keyed or evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

_ROOT = 0  # parent registration id of a sequence's first block; real ids start at 1

CacheKey = tuple[int, tuple[int, ...]]


class BlocksStored(NamedTuple):
    """Full blocks entered the prefix cache: a chain, each the parent of the next."""

    block_hashes: list[int]  # registration ids
    parent_block_hash: int | None  # the first block's parent; None at the root
    token_ids: list[int]  # block_size per block, in order


class BlocksRemoved(NamedTuple):
    block_hashes: list[int]


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class SeqBlocks:
    """One sequence's blocks. Read-only outside this module: the scheduler's steady-decode
    path reads `blocks` and `num_hashed` to skip calls that would change nothing."""

    __slots__ = ("blocks", "num_hashed", "parent")

    def __init__(self, blocks: list[int], num_hashed: int, parent: int) -> None:
        self.blocks = blocks  # physical block ids, in order
        self.num_hashed = num_hashed  # leading blocks that are full, computed and already keyed
        self.parent = parent  # registration id of the cache entry matching block num_hashed-1


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[CacheKey | None] = [None] * num_blocks  # cache key of a registered block
        self._reg = [0] * num_blocks  # registration id of a registered block, 0 if none
        self._next_reg = _ROOT + 1
        self._cached: dict[CacheKey, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, 2, ...
        self.seqs: dict[Hashable, SeqBlocks] = {}  # read-only outside this class
        self._fresh: set[int] = set()  # keyed since begin_step(): computed by the step planned
        # None when not recording. A new pool starts empty: subscribers drop an old pool's blocks.
        self._events: list[KVEvent] | None = [AllBlocksCleared()] if record_events else None

    # ---- queries -------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].blocks

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self.seqs

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return len(self._match(token_ids)) * self.block_size

    def cached_blocks(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """Every block in the prefix cache, as the events name it: hash -> (parent hash, tokens).
        What a subscriber's replay of the events must equal."""
        reg = self._reg
        return {reg[b]: (key[0] or None, key[1]) for key, b in self._cached.items()}

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """ValueError unless a prompt and one generated token fit in the whole pool: a request
        that never could would wait forever."""
        needed = -(-(num_prompt_tokens + 1) // self.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"the prompt needs {needed} KV blocks; the cache has {self.num_blocks}"
            )

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        seq = self.seqs.get(seq_id)
        have = len(seq.blocks) if seq is not None else 0
        return -(-num_tokens // self.block_size) - have <= self.num_free_blocks()

    # ---- allocation ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step is being planned: blocks keyed by earlier plans are safe to read."""
        self._fresh.clear()

    def allocate_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int | None:
        """Take the cached blocks matching a prefix of token_ids; returns the tokens hit, or
        None (taking nothing) when the match runs into a block the step being planned computes:
        next step the same lookup hits it."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        hits = self._match(token_ids)
        if len(hits) < len(token_ids) // self.block_size and self._next_is_fresh(token_ids, hits):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
        parent = self._reg[hits[-1]] if hits else _ROOT
        self.seqs[seq_id] = SeqBlocks(hits, len(hits), parent)
        return len(hits) * self.block_size

    def allocate_slots(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow `seq_id` (created if unknown) to hold num_tokens in total; None if out of blocks."""
        seq = self.seqs.get(seq_id)
        have = len(seq.blocks) if seq is not None else 0
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return []
        if need > self.num_free_blocks():
            return None  # checked up front so that failure changes nothing
        new = [self._take_block() for _ in range(need)]
        if seq is None:
            seq = self.seqs[seq_id] = SeqBlocks([], 0, _ROOT)
        seq.blocks.extend(new)
        return new

    def append_block(self, seq_id: Hashable) -> list[int] | None:
        """allocate_slots for one more block at the end of a held sequence (a decode that
        filled its last block), without the general arithmetic; None if out of blocks."""
        if self._free:  # _take_block's common case, inline: this runs once a block per decode
            b = self._free.pop()
            self._ref[b] = 1
        elif self._lru:
            b = self._take_block()
        else:
            return None
        self.seqs[seq_id].blocks.append(b)
        return [b]

    def cache_blocks(
        self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Key the seq's newly full and computed blocks; O(1) unless a block just filled."""
        seq = self.seqs[seq_id]
        bs = self.block_size
        n_full = min(num_computed_tokens, len(token_ids), len(seq.blocks) * bs) // bs
        if n_full <= seq.num_hashed:
            return
        if not self.enable_prefix_caching:
            return
        parent = seq.parent
        events = self._events
        run_start, run_parent = -1, _ROOT  # a run of newly keyed blocks: one BlocksStored
        for i in range(seq.num_hashed, n_full):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            b = seq.blocks[i]
            canon = self._cached.get(key)
            if canon != b and self._key[b] is not None:  # b is cached with other content
                raise ValueError(f"token_ids of {seq_id!r} disagree with block {b}")
            if canon is None:
                canon = b
                self._key[b] = key
                self._reg[b] = self._next_reg
                self._next_reg += 1
                self._cached[key] = b
                self._fresh.add(b)
                if events is not None and run_start < 0:
                    run_start, run_parent = i, parent
            elif events is not None and run_start >= 0:  # the run of new blocks ends here
                self._record_stored(seq, token_ids, run_start, i, run_parent)
                run_start = -1
            # else: identical content is already cached (maybe b itself); if it is another
            # block, keep that mapping and leave b unkeyed; children chain off the canonical one.
            parent = self._reg[canon]
        if run_start >= 0:
            self._record_stored(seq, token_ids, run_start, n_full, run_parent)
        seq.num_hashed, seq.parent = n_full, parent

    def free(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return  # aborts may race with finishes
        # Tail first: the LRU then evicts a sequence's tail before its (more shareable) head.
        for b in reversed(seq.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False, changing nothing, while
        any sequence holds blocks."""
        if self.seqs:
            return False
        for b in self._lru:
            self._unregister(b)
            self._free.append(b)
        self._lru.clear()
        self._fresh.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    # ---- internals -----------------------------------------------------------------------------

    def _record_stored(
        self, seq: SeqBlocks, token_ids: Sequence[int], start: int, end: int, parent: int
    ) -> None:
        assert self._events is not None
        bs, reg = self.block_size, self._reg
        hashes = [reg[seq.blocks[i]] for i in range(start, end)]
        tokens = list(token_ids[start * bs : end * bs])
        self._events.append(BlocksStored(hashes, parent if parent != _ROOT else None, tokens))

    def _record_removed(self, reg_id: int) -> None:
        assert self._events is not None
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksRemoved):  # evictions of one allocation share an event
            last.block_hashes.append(reg_id)
        else:
            self._events.append(BlocksRemoved([reg_id]))

    def _match(self, token_ids: Sequence[int]) -> list[int]:
        """Longest chain of cached full blocks matching a prefix of token_ids (no refs taken)."""
        if not self.enable_prefix_caching:
            return []
        bs, cached, hits = self.block_size, self._cached, []
        parent = _ROOT
        for i in range(len(token_ids) // bs):
            b = cached.get((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if b is None or b in self._fresh:
                break
            hits.append(b)
            parent = self._reg[b]
        return hits

    def _next_is_fresh(self, token_ids: Sequence[int], hits: list[int]) -> bool:
        """Is the block after `hits` keyed, but fresh (being computed by the step planned)?"""
        bs, i = self.block_size, len(hits)
        parent = self._reg[hits[-1]] if hits else _ROOT
        b = self._cached.get((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
        return b is not None and b in self._fresh

    def _take_block(self) -> int:
        """A block for a sequence (ref 1): a free one, else the least recently freed cached one,
        evicted. The caller has checked that one exists."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            if self._events is not None:
                self._record_removed(self._reg[b])
            self._unregister(b)
        self._ref[b] = 1
        return b

    def _unregister(self, b: int) -> None:
        key = self._key[b]
        assert key is not None
        del self._cached[key]
        self._key[b] = None
        self._reg[b] = 0  # the id is retired: keys chained off it can never match again

    def check_invariants(self) -> None:
        n = self.num_blocks
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate block on the free list"
        assert not free & lru, f"blocks both free and cached: {free & lru}"
        refs = [0] * n
        for sid, seq in self.seqs.items():
            assert len(set(seq.blocks)) == len(seq.blocks), f"{sid!r} holds a block twice"
            assert seq.num_hashed <= len(seq.blocks), f"{sid!r} hashed past its blocks"
            for b in seq.blocks:
                refs[b] += 1
        assert refs == self._ref, "ref counts disagree with the sequences holding blocks"
        in_use = {b for b in range(n) if refs[b] > 0}
        assert not in_use & (free | lru), "a referenced block is free or cached"
        assert len(free) + len(lru) + len(in_use) == n, "a block is in no state"
        for b in free:
            assert self._key[b] is None, f"free block {b} still keyed"
        for b in lru:
            assert self._key[b] is not None, f"cached block {b} has no key"
        for cached_key, b in self._cached.items():
            assert self._key[b] == cached_key, f"cache entry points at block {b} with another key"
        for b in range(n):
            key = self._key[b]
            assert (key is None) == (self._reg[b] == 0), f"block {b}: key/registration mismatch"
            assert key is None or self._cached.get(key) == b, f"keyed block {b} not in the map"
