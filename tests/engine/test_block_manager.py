"""The block pool on its own: exact block ids, free counts, prefix sharing and eviction order.

A pool of 8 blocks of 4 tokens is small enough to reason about every id by hand.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.engine.block_manager import BlockManager
from tests.engine.tiny import make_seq, one_thread

NUM_BLOCKS = 8
BS = 4

assert one_thread  # an autouse fixture: importing it is what applies it here


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(NUM_BLOCKS, BS)


def admit(bm: BlockManager, seq) -> bool:
    """What the scheduler does at admission: reuse the cached prefix, allocate the rest."""
    prefix = bm.find_cached_prefix(seq)
    cached = prefix.num_tokens(BS)
    if not bm.allocate(seq, seq.num_tokens - cached, prefix):
        return False
    seq.num_computed_tokens = cached
    return True


def compute_all(bm: BlockManager, seq) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)


def admitted_and_computed(bm: BlockManager, request_id: str, tokens: list[int], salt: str | None = None,
                          tenant: str | None = None):
    seq = make_seq(request_id, tokens, salt, tenant=tenant)
    assert admit(bm, seq)
    compute_all(bm, seq)
    return seq


# -- allocation -------------------------------------------------------------------------------


def test_allocate_append_free_exact_ids(bm):
    seq = make_seq("a", list(range(6)))
    assert bm.allocate(seq, 6)
    assert seq.block_table == [0, 1]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 2)

    seq.num_computed_tokens = 6
    seq.append_token(7)
    assert bm.allocate(seq, 1)  # token 7 fits in block 1
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 7
    for t in (8, 9):
        seq.append_token(t)
    assert bm.allocate(seq, 2)  # tokens 8 and 9 spill into a third block
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5

    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants([])

    # Never-used blocks go out first; the freed ones went back to the end, tail first.
    other = make_seq("b", list(range(4 * 8)))
    assert bm.allocate(other, 32)
    assert other.block_table == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.num_free_blocks == 0


def test_not_enough_blocks_returns_false_and_changes_nothing(bm):
    big = make_seq("big", list(range(24)))
    assert bm.allocate(big, 24)
    assert bm.num_free_blocks == 2
    refs = list(bm.ref_counts)

    small = make_seq("small", list(range(9)))
    assert not bm.allocate(small, 9)  # needs 3 blocks, 2 left
    assert small.block_table == []
    assert bm.num_free_blocks == 2
    assert bm.ref_counts == refs

    big.num_computed_tokens = 24
    assert not bm.allocate(big, 9)
    assert big.block_table == [0, 1, 2, 3, 4, 5]
    assert bm.ref_counts == refs
    assert bm.allocate(big, 8)  # exactly the 2 left
    assert bm.num_free_blocks == 0
    bm.check_invariants([big])


def test_blocks_needed_rounds_up(bm):
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_prefix_can_only_be_attached_to_a_sequence_without_blocks(bm):
    a = admitted_and_computed(bm, "a", list(range(9)))
    b = make_seq("b", list(range(9)))
    assert bm.allocate(b, 1)
    with pytest.raises(ValueError):
        bm.allocate(b, 1, bm.find_cached_prefix(b))
    bm.check_invariants([a, b])


# -- prefix cache -----------------------------------------------------------------------------


def test_second_sequence_shares_full_blocks(bm):
    a = admitted_and_computed(bm, "a", list(range(10)))
    assert a.block_table == [0, 1, 2]
    assert bm.num_cached_blocks == 2  # the third block holds only 2 tokens

    b = make_seq("b", list(range(8)) + [50, 51, 52])
    prefix = bm.find_cached_prefix(b)
    assert prefix.blocks == (0, 1)
    assert prefix.num_tokens(BS) == 8
    assert bm.allocate(b, 3, prefix)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == NUM_BLOCKS - 4
    bm.check_invariants([a, b])

    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants([])


def test_block_holding_the_last_prompt_token_is_never_taken_from_cache(bm):
    admitted_and_computed(bm, "a", list(range(12)))
    assert bm.num_cached_blocks == 3

    exact = make_seq("exact", list(range(8)))  # two full cached blocks, but token 7 must be computed
    assert bm.find_cached_prefix(exact).blocks == (0,)
    one_more = make_seq("one-more", list(range(9)))
    assert bm.find_cached_prefix(one_more).blocks == (0, 1)
    single = make_seq("single", [0])
    assert bm.find_cached_prefix(single).blocks == ()


def test_a_different_first_block_breaks_the_chain(bm):
    admitted_and_computed(bm, "a", list(range(12)))
    # Same second and third blocks, different first: keys chain on the parent, so no hit at all.
    b = make_seq("b", [9, 9, 9, 9] + list(range(4, 12)) + [0])
    assert bm.find_cached_prefix(b).blocks == ()


def test_freed_cached_blocks_count_as_free_and_are_revived_by_a_hit(bm):
    a = admitted_and_computed(bm, "a", list(range(8)))
    bm.free(a)
    assert bm.num_free_blocks == NUM_BLOCKS
    assert bm.num_cached_blocks == 2

    b = make_seq("b", list(range(8)) + [1])
    assert admit(bm, b)
    assert b.block_table[:2] == [0, 1]
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == NUM_BLOCKS - 3
    bm.check_invariants([b])


def test_revived_blocks_count_against_the_pool(bm):
    a = admitted_and_computed(bm, "a", list(range(8)))
    bm.free(a)
    hog = make_seq("hog", [7] * 24)
    assert bm.allocate(hog, 24)  # the 6 never-used blocks; blocks 0 and 1 stay cached
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2

    # Reviving 0 and 1 uses up the last two free blocks: no room left for the 3rd block.
    b = make_seq("b", list(range(8)) + [1])
    prefix = bm.find_cached_prefix(b)
    assert prefix.blocks == (0, 1)
    assert not bm.allocate(b, 1, prefix)
    assert b.block_table == []
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2
    bm.check_invariants([hog])


def test_eviction_is_least_recently_freed_first_tail_before_head(bm):
    a = admitted_and_computed(bm, "a", [1] * 8)  # blocks 0, 1
    b = admitted_and_computed(bm, "b", [2] * 8)  # blocks 2, 3
    hog = make_seq("hog", [3] * 16)
    assert bm.allocate(hog, 16)  # blocks 4..7: nothing left that was never used
    assert hog.block_table == [4, 5, 6, 7]
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 4

    taken = []
    for i in range(4):
        s = make_seq(f"new-{i}", [4] * 4)
        assert bm.allocate(s, 4)
        taken += s.block_table
        # The head of the older sequence outlives its tail.
        if i == 0:
            assert bm.find_cached_prefix(make_seq("probe", [1] * 8 + [0])).blocks == (0,)
    assert taken == [1, 0, 3, 2]
    assert bm.num_cached_blocks == 0


def test_a_prefix_hit_makes_blocks_recently_used(bm):
    a = admitted_and_computed(bm, "a", [1] * 8)  # blocks 0, 1
    b = admitted_and_computed(bm, "b", [2] * 8)  # blocks 2, 3
    hog = make_seq("hog", [3] * 12)
    assert bm.allocate(hog, 12)  # blocks 4, 5, 6; block 7 is left never-used
    bm.free(a)
    bm.free(b)

    c = make_seq("c", [1] * 8 + [5])
    assert admit(bm, c)
    assert c.block_table == [0, 1, 7]
    bm.free(c)  # 7 is unkeyed (1 token): plain free. 1 then 0 are now the most recent.

    taken = []
    for i in range(5):
        s = make_seq(f"new-{i}", [4] * 4)
        assert bm.allocate(s, 4)
        taken += s.block_table
    assert taken == [7, 3, 2, 1, 0]


def test_different_cache_salt_never_shares(bm):
    tokens = list(range(9))
    a = admitted_and_computed(bm, "a", tokens, salt="tenant-1")
    b = make_seq("b", tokens, salt="tenant-2")
    assert bm.find_cached_prefix(b).blocks == ()
    assert admit(bm, b)
    compute_all(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks == 4
    assert a.block_hashes[0] != b.block_hashes[0]

    unsalted = make_seq("c", tokens)
    assert bm.find_cached_prefix(unsalted).blocks == ()
    same_tenant = make_seq("d", tokens, salt="tenant-1")
    assert bm.find_cached_prefix(same_tenant).blocks == tuple(a.block_table[:2])


def test_reset_prefix_cache_forgets_unreferenced_blocks_only(bm):
    a = admitted_and_computed(bm, "a", [1] * 9)
    b = admitted_and_computed(bm, "b", [2] * 9)
    bm.free(a)
    assert bm.num_cached_blocks == 4

    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2
    assert bm.find_cached_prefix(make_seq("x", [1] * 9)).blocks == ()
    assert bm.find_cached_prefix(make_seq("y", [2] * 9)).blocks == tuple(b.block_table[:2])
    assert bm.num_free_blocks == NUM_BLOCKS - 3
    bm.check_invariants([b])

    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants([])


def test_disabled_prefix_caching_keys_nothing():
    bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    a = admitted_and_computed(bm, "a", list(range(9)))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_seq("b", list(range(9)))).blocks == ()
    bm.free(a)
    assert bm.num_free_blocks == NUM_BLOCKS


def test_twins_computed_together_keep_one_cached_block(bm):
    a = make_seq("a", list(range(9)), tenant="A")
    b = make_seq("b", list(range(9)), tenant="B")
    assert admit(bm, a) and admit(bm, b)  # neither is computed yet: no hit
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.num_cached_blocks == 2
    assert set(bm.cached.values()) == set(a.block_table[:2])
    assert b.block_hashes == a.block_hashes
    # The block is A's, but B computed the same tokens itself: each is told of its hit.
    assert reported(bm, list(range(9)), "A") == reported(bm, list(range(9)), "B") == 8
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants([])


# -- what a hit tells a tenant ----------------------------------------------------------------
# Tenants of a tier that shares its cache have one salt: they reuse each other's blocks, but
# a tenant's cached count (usage.cached_tokens) covers only the blocks it had before.


def reported(bm: BlockManager, tokens: list[int], tenant: str) -> int:
    return bm.find_cached_prefix(make_seq("probe", tokens, tenant=tenant)).num_known_tokens(BS)


def test_another_tenants_blocks_are_reused_but_not_reported(bm):
    secret = list(range(9))
    a = admitted_and_computed(bm, "a", secret, tenant="A")
    assert a.block_table == [0, 1, 2]

    b = make_seq("b", secret, tenant="B")
    prefix = bm.find_cached_prefix(b)
    assert prefix.blocks == (0, 1)  # B computes only its last token...
    assert prefix.num_known_tokens(BS) == 0  # ...and is told of no hit
    assert admit(bm, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert reported(bm, secret, "A") == 8  # A's own hit counts
    bm.check_invariants([a, b])


def test_a_repeat_reports_the_same_whether_the_first_guess_hit_another_tenant_or_not(bm):
    """B cannot confirm a guess by sending it twice: its second request is told of the blocks
    its first one was served, whoever computed them."""
    secret, wrong = list(range(9)), [5] * 9
    a = admitted_and_computed(bm, "a", secret, tenant="A")
    answers = {}
    for name, guess in (("right", secret), ("wrong", wrong)):
        told_first = reported(bm, guess, "B")
        first = admitted_and_computed(bm, f"b-{name}", guess, tenant="B")
        answers[name] = (told_first, reported(bm, guess, "B"))
        bm.check_invariants([a, first])
        bm.free(first)
    assert answers["right"] == answers["wrong"] == (0, 8)
    assert reported(bm, secret, "A") == 8


def test_reporting_stops_at_the_first_block_the_tenant_has_not_had(bm):
    a = admitted_and_computed(bm, "a", list(range(9)), tenant="A")  # keys blocks 0, 1
    b = admitted_and_computed(bm, "b", list(range(13)), tenant="B")  # reuses 0, 1; keys block 3
    assert b.block_table == [0, 1, 3, 4]
    probe = make_seq("probe", list(range(13)), tenant="A")
    prefix = bm.find_cached_prefix(probe)
    assert prefix.blocks == (0, 1, 3)
    assert prefix.num_known_tokens(BS) == 8
    assert reported(bm, list(range(13)), "B") == 12  # served 0 and 1 before, computed 3 itself
    bm.check_invariants([a, b])


def test_an_evicted_block_entered_again_belongs_to_its_new_tenant(bm):
    tokens = [1] * 9
    a = admitted_and_computed(bm, "a", tokens, tenant="A")
    bm.free(a)
    hog = make_seq("hog", [3] * 32, tenant="H")
    assert bm.allocate(hog, 32)  # the whole pool: blocks 1 and 0 are evicted last
    assert hog.block_table == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.num_cached_blocks == 0
    bm.free(hog)

    b = admitted_and_computed(bm, "b", tokens, tenant="B")
    assert b.block_table == [0, 1, 2]  # A's old blocks, holding the same tokens again
    assert bm.find_cached_prefix(make_seq("probe", tokens, tenant="A")).blocks == (0, 1)
    assert reported(bm, tokens, "A") == 0
    assert reported(bm, tokens, "B") == 8
    bm.check_invariants([b])


# -- random interleavings ---------------------------------------------------------------------

ALPHABET = st.integers(0, 2)  # three token ids: prefixes collide all the time
TENANTS = st.sampled_from(["A", "B"])


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admit / append / compute / free on a tiny pool.

    A shadow of every slot records which (salt, token prefix) its keys and values
    were computed from, so sharing a block between sequences whose prefixes differ
    would show up as a wrong slot, not only as bad bookkeeping. Another records the
    blocks each tenant has had (computed or been served), so a hit that told a tenant
    of a block it never had would show up too.
    """

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.live = []
        self.slots: dict[int, tuple] = {}  # slot -> (salt, token prefix ending at that slot's token)
        self.had: set[tuple] = set()  # (tenant, salt, token prefix ending a full block)
        self.n = 0

    def _write(self, seq, start: int, end: int) -> None:
        for p in range(start, end):
            block = seq.block_table[p // BS]
            assert self.bm.ref_counts[block] == 1, "a sequence wrote into a block another one reads"
            self.slots[block * BS + p % BS] = (seq.cache_salt, tuple(seq.token_ids[: p + 1]))

    def _had(self, seq) -> None:
        for i in range(seq.num_computed_tokens // BS):
            self.had.add((seq.tenant_id, seq.cache_salt, tuple(seq.token_ids[: (i + 1) * BS])))

    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=14), salt=st.sampled_from([None, None, "t"]),
          tenant=TENANTS)
    def admit(self, tokens, salt, tenant):
        seq = make_seq(f"s{self.n}", tokens, salt, tenant=tenant)
        self.n += 1
        before = (self.bm.num_free_blocks, list(self.bm.ref_counts), dict(self.bm.cached))
        if admit(self.bm, seq):
            self.live.append(seq)
            self._had(seq)
        else:
            assert seq.block_table == []
            assert (self.bm.num_free_blocks, list(self.bm.ref_counts), dict(self.bm.cached)) == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def compute(self, i):
        seq = self.live[i % len(self.live)]
        self._write(seq, seq.num_computed_tokens, seq.num_tokens)
        compute_all(self.bm, seq)
        self._had(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tokens=st.lists(ALPHABET, min_size=1, max_size=6))
    def append(self, i, tokens):
        seq = self.live[i % len(self.live)]
        table = list(seq.block_table)
        free = self.bm.num_free_blocks
        for t in tokens:
            seq.append_token(t)
        if not self.bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            assert seq.block_table == table and self.bm.num_free_blocks == free
            del seq.token_ids[-len(tokens) :]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        assert seq.block_table == []

    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=14), salt=st.sampled_from([None, "t"]), tenant=TENANTS)
    def find_cached_prefix(self, tokens, salt, tenant):
        self._probe(tokens, salt, tenant)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tenant=TENANTS)
    def find_a_live_prompt(self, i, tenant):
        # Random probes rarely repeat a cached prompt; another tenant's guess of one does.
        seq = self.live[i % len(self.live)]
        self._probe(list(seq.token_ids), seq.cache_salt, tenant)

    def _probe(self, tokens, salt, tenant):
        seq = make_seq("probe", tokens, salt, tenant=tenant)
        prefix = self.bm.find_cached_prefix(seq)
        assert prefix.num_tokens(BS) <= len(tokens) - 1
        assert prefix.num_known_blocks <= len(prefix.blocks)
        for i in range(prefix.num_known_blocks):
            assert (tenant, salt, tuple(tokens[: (i + 1) * BS])) in self.had, "told of a block it never had"
        for i, (block, key) in enumerate(zip(prefix.blocks, prefix.hashes)):
            assert self.bm.cached[key] == block
            for p in range(i * BS, (i + 1) * BS):
                assert self.slots[block * BS + p % BS] == (salt, tuple(tokens[: p + 1]))

    @invariant()
    def books_balance(self):
        bm = self.bm
        bm.check_invariants(self.live)
        assert bm.num_free_blocks + bm.num_used_blocks == NUM_BLOCKS
        assert bm.num_used_blocks == len({b for s in self.live for b in s.block_table})
        owners: dict[int, int] = {}
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) == bm.blocks_needed(seq.num_tokens)
            for b in seq.block_table:
                owners[b] = owners.get(b, 0) + 1
        for b, n in owners.items():
            if n > 1:
                key = bm.block_hashes[b]
                assert key is not None and bm.cached[key] == b, f"block {b} shared outside the prefix cache"

    @invariant()
    def computed_slots_hold_this_sequences_prefix(self):
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                slot = seq.block_table[p // BS] * BS + p % BS
                assert self.slots.get(slot) == (seq.cache_salt, tuple(seq.token_ids[: p + 1]))

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == NUM_BLOCKS


BlockPoolMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_pool_random_interleavings = BlockPoolMachine.TestCase
