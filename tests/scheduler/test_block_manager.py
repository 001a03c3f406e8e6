from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from stoker.services.scheduler.block_manager import (
    AllBlocksCleared,
    BlockManager,
    BlocksRemoved,
    BlocksStored,
)

BS = 4


def run_prompt(bm: BlockManager, sid: str, prompt: list[int]) -> int:
    """Admit and fully prefill a prompt the way the scheduler does; returns the cached tokens."""
    hit = bm.allocate_prefix(sid, prompt[:-1])
    assert bm.allocate_slots(sid, len(prompt)) is not None
    bm.cache_blocks(sid, prompt, len(prompt))
    bm.check_invariants()
    bm.begin_step()  # later lookups belong to later steps
    return hit


def test_allocate_free_round_trip() -> None:
    bm = BlockManager(8, BS)
    assert bm.allocate_prefix("a", list(range(9))) == 0
    new = bm.allocate_slots("a", 10)
    assert new == bm.block_table("a") and len(new) == 3
    assert bm.allocate_slots("a", 12) == []  # still fits in 3 blocks
    assert bm.allocate_slots("a", 13) == [new[-1] + 1]
    assert bm.num_free_blocks() == 4 and bm.usage() == 0.5
    bm.check_invariants()
    bm.free("a")
    assert not bm.has_seq("a") and bm.num_free_blocks() == 8 and bm.usage() == 0.0
    bm.check_invariants()


def test_prefix_hit_after_free_is_content_verified() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # 2 full blocks + a partial one
    run_prompt(bm, "a", prompt)
    table = list(bm.block_table("a"))
    bm.free("a")
    assert bm.num_cached_tokens(prompt) == 8  # the partial block is not cached
    assert bm.num_cached_tokens(prompt[:7]) == 4  # only full blocks of the query count
    assert bm.allocate_prefix("b", prompt[:-1]) == 8
    assert bm.block_table("b") == table[:2]
    # Same second block after a different first block: the chain stops at block 0.
    assert bm.num_cached_tokens([9, 9, 9, 9] + prompt[4:]) == 0
    assert bm.num_cached_tokens(prompt[:4] + [9, 9, 9, 9]) == 4
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    bm = BlockManager(5, BS)
    a, b = list(range(12)), list(range(100, 108))
    run_prompt(bm, "a", a)  # blocks 0, 1, 2
    run_prompt(bm, "b", b)  # blocks 3, 4
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks() == 5 and bm.usage() == 0.0
    assert bm.allocate_slots("c", 1) == [2]  # a's tail goes first
    assert bm.num_cached_tokens(a) == 8 and bm.num_cached_tokens(b) == 8
    assert bm.allocate_slots("c", 9) == [1, 0]  # then the rest of a, head last
    assert bm.num_cached_tokens(a) == 0 and bm.num_cached_tokens(b) == 8
    bm.check_invariants()


def test_hit_refreshes_lru_position() -> None:
    bm = BlockManager(4, BS)
    a, b = list(range(8)), list(range(100, 108))
    run_prompt(bm, "a", a)  # blocks 0, 1
    run_prompt(bm, "b", b)  # blocks 2, 3
    bm.free("a")
    bm.free("b")
    assert bm.allocate_prefix("a2", a) == 8  # ref 0 -> 1 takes a's blocks out of the LRU
    bm.free("a2")  # ... and puts them back as most recent
    assert bm.allocate_slots("c", 8) == [3, 2]
    assert bm.num_cached_tokens(a) == 8 and bm.num_cached_tokens(b) == 0


def test_failed_allocate_slots_changes_nothing() -> None:
    bm = BlockManager(4, BS)
    run_prompt(bm, "a", list(range(8)))
    bm.free("a")  # 2 cached + 2 free
    bm.allocate_prefix("b", [7, 7, 7])
    assert not bm.can_allocate("b", 17) and bm.can_allocate("b", 16)
    assert not bm.can_allocate("new", 17) and bm.can_allocate("new", 16)
    assert bm.allocate_slots("b", 17) is None
    assert bm.allocate_slots("new", 17) is None and not bm.has_seq("new")
    assert bm.block_table("b") == [] and bm.num_free_blocks() == 4
    assert bm.num_cached_tokens(list(range(8))) == 8  # nothing was evicted
    bm.check_invariants()


def test_append_block_takes_what_allocate_slots_would() -> None:
    """The steady-decode shortcut: one block at the end, free ones first, then the LRU's oldest
    cached block (evicted), then None with nothing changed; twins built with allocate_slots
    end in the same state."""
    twins = BlockManager(5, BS, record_events=True), BlockManager(5, BS, record_events=True)
    for bm in twins:
        run_prompt(bm, "a", list(range(8)))  # blocks 0, 1, cached
        bm.free("a")
        bm.allocate_slots("b", 4)  # block 2: the free stack's next
    short, general = twins
    got = [short.append_block("b"), short.append_block("b"), short.append_block("b")]
    want = [general.allocate_slots("b", 8), general.allocate_slots("b", 12)]
    want.append(general.allocate_slots("b", 16))
    assert got == want == [[3], [4], [1]]  # free blocks, then a's tail evicted first
    assert short.block_table("b") == general.block_table("b")
    assert short.take_events() == general.take_events()
    assert short.append_block("b") == [0] and short.append_block("b") is None
    assert short.block_table("b") == [2, 3, 4, 1, 0] and short.num_free_blocks() == 0
    short.check_invariants()


def test_identical_blocks_computed_concurrently_keep_first_mapping() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    for sid in ("a", "b"):  # both admitted before either computed anything
        assert bm.allocate_prefix(sid, prompt[:-1]) == 0
        bm.allocate_slots(sid, len(prompt))
    for sid in ("a", "b"):
        bm.cache_blocks(sid, prompt, len(prompt))
        bm.check_invariants()
    a_table = list(bm.block_table("a"))
    bm.begin_step()
    bm.free("b")  # b's copies are unkeyed: straight back to the free list
    bm.free("a")
    assert bm.allocate_prefix("c", prompt) == 8 and bm.block_table("c") == a_table[:2]
    bm.check_invariants()


def test_cache_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(10))
    assert run_prompt(bm, "a", prompt) == 0
    bm.free("a")
    assert bm.num_cached_tokens(prompt) == 0
    assert run_prompt(bm, "b", prompt) == 0
    bm.free("b")
    assert bm.num_free_blocks() == 8
    bm.check_invariants()


def test_blocks_keyed_this_step_are_shared_from_the_next() -> None:
    """A block keyed while a step is planned is computed by that step: another request in the
    same step must not read it (None: wait), and from the next step it is a plain hit."""
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    bm.begin_step()
    assert bm.allocate_prefix("a", prompt[:-1]) == 0
    bm.allocate_slots("a", len(prompt))
    bm.cache_blocks("a", prompt, len(prompt))  # planned: keyed now
    assert bm.allocate_prefix("b", prompt[:-1]) is None and not bm.has_seq("b")
    assert bm.num_cached_tokens(prompt) == 0
    assert bm.allocate_prefix("c", [7, 7, 7, 7, 7]) == 0  # other prompts are unaffected
    bm.begin_step()
    assert bm.allocate_prefix("b", prompt[:-1]) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    bm.check_invariants()
    for sid in ("a", "b", "c"):
        bm.free(sid)
    assert bm.num_free_blocks() == 8
    bm.check_invariants()


def test_check_prompt() -> None:
    bm = BlockManager(3, BS)
    bm.check_prompt(11)  # 12 tokens with the first generated one: 3 blocks
    with pytest.raises(ValueError, match="the prompt needs 4 KV blocks; the cache has 3"):
        bm.check_prompt(12)


def test_free_unknown_and_double_free_are_harmless() -> None:
    bm = BlockManager(4, BS)
    bm.free("nope")
    run_prompt(bm, "a", list(range(5)))
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks() == 4
    bm.check_invariants()
    bm.allocate_prefix("b", [1])
    with pytest.raises(ValueError):  # a live seq id cannot be admitted twice
        bm.allocate_prefix("b", [1])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random workloads over a tiny vocab so that prefixes collide often.

    Alongside the manager it models what each physical block holds, writing tokens into the
    block table as the worker would, and checks every prefix hit against that content. A block's
    KV depends on every token before it, so the model records the whole prefix it was computed
    under, not just its own tokens.
    """

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.content: dict[int, tuple[int, ...] | None] = {}  # block -> prefix it was computed for
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def _write(self, sid: str, upto: int) -> None:
        """The worker computes tokens [computed, upto) into the seq's blocks."""
        table = self.bm.block_table(sid)
        others = {b for s in self.tokens if s != sid for b in self.bm.block_table(s)}
        for p in range(self.computed[sid], upto):
            b = table[p // self.bs]
            assert b not in others, f"{sid} writes into shared block {b}"
            self.content[b] = tuple(self.tokens[sid][: p + 1])
        self.computed[sid] = upto
        self.bm.cache_blocks(sid, self.tokens[sid], upto)

    def _grow(self, sid: str) -> bool:
        n = len(self.tokens[sid])
        ok = self.bm.can_allocate(sid, n)
        before = (list(self.bm.block_table(sid)), self.bm.num_free_blocks())
        new = self.bm.allocate_slots(sid, n)
        assert ok == (new is not None)
        if new is None:
            assert (self.bm.block_table(sid), self.bm.num_free_blocks()) == before
            return False
        for b in new:
            self.content[b] = None  # fresh block: stale content is gone
        assert len(self.bm.block_table(sid)) == -(-n // self.bs)
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, prompt: list[int]) -> None:
        sid = f"s{self.next_id}"
        self.next_id += 1
        expected = self.bm.num_cached_tokens(prompt[:-1])
        hit = self.bm.allocate_prefix(sid, prompt[:-1])
        if hit is None:  # the next block was keyed in this step: the scheduler waits a step
            assert expected < (len(prompt) - 1) // self.bs * self.bs and not self.bm.has_seq(sid)
            return
        assert hit == expected and hit % self.bs == 0 and hit < len(prompt)
        for i, b in enumerate(self.bm.block_table(sid)):
            assert self.content[b] == tuple(prompt[: (i + 1) * self.bs]), "false hit"
        self.tokens[sid], self.computed[sid] = list(prompt), hit
        if not self._grow(sid):
            self.bm.free(sid)  # the scheduler would leave it waiting
            del self.tokens[sid], self.computed[sid]
            return
        self._write(sid, len(prompt))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[sid] += new
        if self._grow(sid):
            self._write(sid, len(self.tokens[sid]))
        else:
            del self.tokens[sid][-len(new) :]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens) + ["unknown"]))
        self.bm.free(sid)
        self.tokens.pop(sid, None)
        self.computed.pop(sid, None)

    @rule()
    def next_step(self) -> None:
        self.bm.begin_step()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for sid in list(self.tokens):
            self.bm.free(sid)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks() == self.bm.num_blocks and self.bm.usage() == 0.0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


# ---- KV events -----------------------------------------------------------------------------------


def replay(events, index: dict[int, tuple[int | None, tuple[int, ...]]], bs: int) -> None:
    """Apply events as a router's subscriber does: hash -> (parent hash, the block's tokens)."""
    for e in events:
        if isinstance(e, BlocksStored):
            assert len(e.token_ids) == bs * len(e.block_hashes)
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert h not in index, f"block {h} stored twice"
                index[h] = (parent, tuple(e.token_ids[i * bs : (i + 1) * bs]))
                parent = h
        elif isinstance(e, BlocksRemoved):
            for h in e.block_hashes:
                del index[h]  # KeyError: removed a block never stored
        else:
            assert isinstance(e, AllBlocksCleared)
            index.clear()


def test_events_disabled_record_nothing() -> None:
    bm = BlockManager(4, BS)
    run_prompt(bm, "a", list(range(9)))
    assert bm._events is None and bm.take_events() == []


def test_events_chain_store_and_evict() -> None:
    bm = BlockManager(4, BS, record_events=True)
    assert bm.take_events() == [AllBlocksCleared()]  # a new pool: subscribers start afresh
    run_prompt(bm, "a", list(range(9)))  # 2 full blocks keyed, the third partial
    (stored,) = bm.take_events()
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    h1, h2 = stored.block_hashes
    assert bm.cached_blocks() == {h1: (None, (0, 1, 2, 3)), h2: (h1, (4, 5, 6, 7))}
    bm.free("a")
    assert bm.take_events() == []  # freed blocks stay cached
    # Shares block 1, then diverges: only the new block is stored, chained off h1.
    run_prompt(bm, "b", [0, 1, 2, 3, 9, 9, 9, 9, 5])
    (stored,) = bm.take_events()
    assert stored.parent_block_hash == h1 and stored.token_ids == [9, 9, 9, 9]
    (hb,) = stored.block_hashes
    bm.free("b")
    # Needs the whole pool: evicts the 3 cached blocks, least recently freed first, in one
    # event, then stores its own 4 (as one chain).
    run_prompt(bm, "c", [7] * 16)
    removed, stored = bm.take_events()
    assert removed == BlocksRemoved([h2, hb, h1])
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 4
    assert not {h1, h2, hb} & set(stored.block_hashes)  # ids are never reused
    assert bm.cached_blocks() == {
        h: (p, (7,) * 4) for h, p in zip(stored.block_hashes, [None, *stored.block_hashes])
    }


def test_events_reset_prefix_cache() -> None:
    bm = BlockManager(8, BS, record_events=True)
    run_prompt(bm, "a", list(range(9)))
    assert not bm.reset_prefix_cache()  # a sequence holds blocks
    bm.free("a")
    bm.take_events()
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()] and bm.cached_blocks() == {}
    assert bm.num_free_blocks() == 8 and bm.num_cached_tokens(list(range(9))) == 0
    bm.check_invariants()


class EventsMachine(BlockManagerMachine):
    """The same random workloads with events on: replaying them always gives exactly the
    manager's prefix cache (hashes, parent links and token ids), through evictions."""

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        super().setup.__wrapped__(self, num_blocks, block_size, caching)  # type: ignore[attr-defined]
        self.bm = BlockManager(num_blocks, block_size, caching, record_events=True)
        self.index: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    @rule()
    def reset(self) -> None:
        if self.bm.reset_prefix_cache():
            assert self.bm.cached_blocks() == {}

    @invariant()
    def replays_to_cache(self) -> None:
        if hasattr(self, "bm"):
            replay(self.bm.take_events(), self.index, self.bs)
            assert self.index == self.bm.cached_blocks()


EventsMachine.TestCase.settings = BlockManagerMachine.TestCase.settings
test_block_manager_events_state_machine = EventsMachine.TestCase
