"""The pool of KV-cache blocks: allocation, reference counts and the prefix cache.

A block holds `block_size` consecutive tokens of one sequence. Once full and
computed, a block is keyed by hash(parent block's key, its token ids, cache salt)
so another sequence with the same prefix (and the same salt) can share it instead
of recomputing. Unreferenced keyed blocks stay readable until the pool needs them
back, least recently used first.

Each cached block also remembers the tenants that have had its tokens computed for them
(the tenant that entered it, and each tenant a hit later served it to). A hit reports
to a tenant only the leading blocks it has had before: sharing a block saves another
tenant the compute, but its cached-token count must not tell it what someone else sent.

"Not enough blocks" is an ordinary answer (False), never an exception: the
scheduler decides what to do about it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from inference.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    # A cryptographic hash, not hash(): a collision would let one sequence (or tenant)
    # read another's keys and values.
    h = hashlib.sha256(parent or b"\0")
    h.update(b"\0" if salt is None else b"\1" + salt.encode() + b"\0")  # "" is a salt too, not None
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class CachedPrefix:
    blocks: tuple[int, ...]
    hashes: tuple[bytes, ...]
    num_known_blocks: int = 0  # leading blocks the sequence's tenant had before (computed or was served)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size

    def num_known_tokens(self, block_size: int) -> int:
        """The hit a tenant may be told of: the rest of it would confirm another tenant's prompt."""
        return self.num_known_blocks * block_size


NO_PREFIX = CachedPrefix((), ())


class SwapPool:
    """Host-memory blocks that hold swapped-out sequences. No sharing, no prefix cache."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_swap_blocks: int = 0):
        self.swap = SwapPool(num_swap_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.known_to: dict[int, set[str | None]] = {}  # cached block -> tenants that have had its tokens
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, keyed, least recently used first

    # -- counts ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest chain of cached blocks covering the start of `seq`'s tokens.

        The block holding the last token is never taken from the cache: that token
        must be computed to give the logits of the next one.
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        bs = self.block_size
        blocks, hashes = [], []
        known = 0
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            key = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt)
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
            hashes.append(key)
            if known == i and seq.tenant_id in self.known_to[block]:
                known += 1
            parent = key
        return CachedPrefix(tuple(blocks), tuple(hashes), known)

    def commit_blocks(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Key every block of `seq` that is full within its first `num_tokens` tokens.

        The scheduler calls this for the tokens a step is about to compute, so a
        sequence admitted later in the same step can already share those blocks:
        each layer writes the whole batch's keys and values before any attention
        reads them. Returns the blocks newly entered into the prefix cache.
        """
        bs = self.block_size
        token_ids = seq.token_ids
        entered = []
        while len(seq.block_hashes) < num_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            key = block_hash(parent, token_ids[i * bs : (i + 1) * bs], seq.cache_salt)
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if not self.enable_prefix_caching:
                continue
            # A twin computed alongside may already own the key: keep the first one, and let
            # it count for this tenant too, which computed the same tokens itself.
            if key in self.cached:
                self.known_to[self.cached[key]].add(seq.tenant_id)
            elif self.block_hashes[block] is None:
                self.cached[key] = block
                self.block_hashes[block] = key
                self.known_to[block] = {seq.tenant_id}
                entered.append(block)
        return entered

    def commit_computed(self, seq: Sequence) -> list[int]:
        """Key every block of `seq` that is full of computed tokens."""
        return self.commit_blocks(seq, seq.num_computed_tokens)

    def forget(self, blocks) -> None:
        """Take blocks out of the prefix cache: their contents were never computed (a failed step)."""
        for block in blocks:
            if self.block_hashes[block] is None:
                continue
            self._unkey(block)
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    # -- allocation -----------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        return self._shortfall(seq, num_new_tokens, prefix) <= 0

    def _shortfall(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix) -> int:
        total = seq.num_computed_tokens + prefix.num_tokens(self.block_size) + num_new_tokens
        required = self.blocks_needed(total) - len(seq.block_table) - len(prefix.blocks)
        # A cached block nobody references counts as free now; taking it uses up that room.
        revived = sum(1 for b in prefix.blocks if self.ref_counts[b] == 0)
        return required + revived - self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens, reusing `prefix` first.

        `prefix` may only be passed while the sequence holds no blocks (admission).
        Returns False, changing nothing, when the pool cannot cover it.
        """
        if prefix.blocks and seq.block_table:
            raise ValueError("a cached prefix can only be attached to a sequence that holds no blocks")
        if self._shortfall(seq, num_new_tokens, prefix) > 0:
            return False
        for block in prefix.blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            # Served to this tenant now: its next hit on the block is one it may be told of.
            self.known_to[block].add(seq.tenant_id)
        seq.block_table.extend(prefix.blocks)
        seq.block_hashes.extend(prefix.hashes)
        total = seq.num_computed_tokens + prefix.num_tokens(self.block_size) + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unkey(block)
        self.ref_counts[block] = 1
        return block

    def _unkey(self, block: int) -> None:
        del self.cached[self.block_hashes[block]]
        del self.known_to[block]
        self.block_hashes[block] = None

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its tail goes back first, so the shared head
        of a prompt is the last of its blocks to be evicted."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []

    def release_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks past its first `num_tokens` tokens: those a speculative step took
        for draft tokens the target rejected. They are never keyed (keys cover computed tokens
        only), so they go straight back to the free list."""
        keep = self.blocks_needed(num_tokens)
        for block in seq.block_table[keep:]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
        del seq.block_table[keep:]

    # -- swapping --------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= self.swap.num_free_blocks

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq` to host blocks; returns (device block, host block) copies to make.

        The device blocks are released (blocks shared through the prefix cache stay
        with their other owners); the caller must copy before anything overwrites them,
        which the model runner does at the start of the step.
        """
        host = self.swap.allocate(len(seq.block_table))
        if host is None:
            raise ValueError("swap pool full: check can_swap_out first")
        copies = list(zip(seq.block_table, host))
        self.free(seq)
        seq.swap_table = host
        return copies

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Give `seq` device blocks again; returns (host block, device block) copies, or None if it does not fit."""
        n = len(seq.swap_table)
        if n > self.num_free_blocks:
            return None
        device = [self._take_free_block() for _ in range(n)]
        copies = list(zip(seq.swap_table, device))
        self.swap.free(seq.swap_table)
        seq.swap_table = []
        seq.block_table = device
        return copies

    def free_swapped(self, seq: Sequence) -> None:
        self.swap.free(seq.swap_table)
        seq.swap_table = []

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        for block in list(self._evictable):
            self._unkey(block)
            self._free.append(block)
        self._evictable.clear()

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError if the pool's books disagree with the sequences' tables."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            for block in seq.block_table:
                owners[block] += 1
        if owners != self.ref_counts:
            raise AssertionError("reference counts disagree with the sequences' block tables")
        free = set(self._free)
        evictable = set(self._evictable)
        if free & evictable or len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        for block in range(self.num_blocks):
            idle = self.ref_counts[block] == 0
            if idle != (block in free or block in evictable):
                raise AssertionError(f"block {block} is both used and free, or neither")
        if self.num_free_blocks + sum(1 for r in self.ref_counts if r) != self.num_blocks:
            raise AssertionError("free + used != total")
        for key, block in self.cached.items():
            if self.block_hashes[block] != key:
                raise AssertionError("prefix cache map disagrees with block keys")
        if self.known_to.keys() != set(self.cached.values()):
            raise AssertionError("a cached block without its tenants, or tenants of an uncached block")
        swapped = [b for seq in seqs for b in seq.swap_table]
        if len(set(swapped)) != len(swapped) or set(swapped) & set(self.swap._free):
            raise AssertionError("a swap block is owned twice, or owned and free")
        if len(swapped) + self.swap.num_free_blocks != self.swap.num_blocks:
            raise AssertionError("swap pool: free + used != total")
