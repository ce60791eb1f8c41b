"""The paged KV cache's bookkeeping: which fixed-size block of one pool holds which positions of which
sequence; the device cache (``kv_cache``) and its attention build on this.

A sequence owns a block table: block ids in position order, ``block_size`` positions each, the last one
partly filled. Blocks are reference-counted so that sequences with a common prefix share it: the n samples of
a prompt share the prompt's full blocks (``fork``), and a full block is also found again by its prefix hash,
so a later sequence with the same leading tokens (another request in the same call, or a multi-turn
continuation) reuses the blocks instead of prefilling them. The hash of block i chains the hash of block i - 1
with block i's tokens, so equal hashes mean equal prefixes; the tokens are compared too, so a hash collision
can never hand a sequence another's cache.

A block whose count falls to zero goes back to the free list but keeps its hash and contents until it is
handed out again, least recently freed first: a prefix that comes back soon is still found. A partly filled
last block is never shared for writing: ``fork`` gives each new sequence a block of its own for it, and says
which copy the device must make (copy-on-write before the first divergent token).

Plain Python on the host; the device tensors are the engine's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than an operation needs (the scheduler preempts, it never asks blindly)."""


@dataclass
class Block:
    """One block of the pool: its users, and (when full and hashed) the prefix it holds."""

    id: int
    ref_count: int = 0
    hash: int | None = None  # the chained prefix hash, set once the block is full
    tokens: tuple[int, ...] = ()  # the tokens of a hashed block, to rule out collisions


@dataclass
class PoolStats:
    """What ``rollout/kv_blocks_used`` and ``rollout/prefix_cache_hit_rate`` report."""

    peak_used: int = 0
    queried_blocks: int = 0  # full blocks looked up by hash in ``allocate``
    hit_blocks: int = 0  # of which were found cached
    forked_blocks: int = 0  # full blocks shared by ``fork``

    @property
    def hit_rate(self) -> float:
        """The fraction of looked-up full blocks that were found cached (0 when none were looked up)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


def chain_hash(previous: int | None, tokens: Sequence[int]) -> int:
    """The prefix hash of a full block: the previous block's hash and this block's tokens."""
    return hash((previous, tuple(tokens)))


@dataclass
class BlockTable:
    """One sequence's blocks in position order and how many positions it holds."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    cached_tokens: int = 0  # the leading tokens whose blocks were found cached (need no prefill)
    hashed: int = 0  # leading blocks whose prefix hash is known (-1: the chain broke, hash no more)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions: allocate, fork, grow and free block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks and positions: got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest-freed first
        self.by_hash: dict[int, int] = {}  # prefix hash -> block id (used or free-but-intact)
        self.stats = PoolStats()

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may still hold a cached prefix)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self.blocks) - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` positions take."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether ``allocate(token_ids)`` would succeed: blocks found cached are shared, not taken (but a
        cached block nobody holds leaves the free list)."""
        found = self._leading_cached(token_ids)
        revived = sum(block.ref_count == 0 for block in found)
        return self.blocks_for(len(token_ids)) - len(found) + revived <= self.num_free

    def allocate(self, token_ids: Sequence[int]) -> BlockTable:
        """A block table for a new sequence of ``token_ids``: leading full blocks found by their prefix hash are
        shared (``cached_tokens`` says how many positions need no prefill), the rest taken from the free list."""
        if not self.can_allocate(token_ids):
            raise PoolExhausted(
                f"{self.blocks_for(len(token_ids))} blocks for {len(token_ids)} tokens, {self.num_free} free"
            )
        table, previous, hitting = BlockTable(), None, True
        for tokens in self._full_chunks(token_ids):
            previous = chain_hash(previous, tokens)
            self.stats.queried_blocks += 1
            block = self._cached(previous, tokens) if hitting else None
            if block is not None:
                self.stats.hit_blocks += 1
                table.cached_tokens += self.block_size
                self._hold(block)
            else:
                hitting = False  # a chained hash after a miss can only miss
                block = self._take()
                self._register(block, previous, tokens)
            table.blocks.append(block.id)
        if len(token_ids) % self.block_size:
            table.blocks.append(self._take().id)
        table.num_tokens = len(token_ids)
        table.hashed = len(token_ids) // self.block_size
        return table

    def fork(self, table: BlockTable) -> tuple[BlockTable, tuple[int, int] | None]:
        """A new sequence sharing ``table``'s full blocks, with a block of its own for a partly filled last one.

        Returns the new table and (source, destination) of the block copy the device must make, or None."""
        full = table.num_tokens // self.block_size
        partial = len(table.blocks) > full
        if partial and not self.num_free:
            raise PoolExhausted("no free block for a forked sequence's last, partly filled block")
        out = BlockTable(
            list(table.blocks[:full]), table.num_tokens, table.cached_tokens, min(table.hashed, full)
        )
        for block_id in out.blocks:
            self._hold(self.blocks[block_id])
        self.stats.forked_blocks += full
        copy = None
        if partial:
            own = self._take()
            out.blocks.append(own.id)
            copy = (table.blocks[full], own.id)
        return out, copy

    def append(self, table: BlockTable, token_ids: Sequence[int], all_tokens: Sequence[int]) -> None:
        """Grow ``table`` by ``token_ids`` (sampled or extended tokens); ``all_tokens`` is the whole sequence
        after them, whose blocks that fill up are hashed so that later sequences can find them."""
        assert len(all_tokens) == table.num_tokens + len(token_ids), "all_tokens must end with token_ids"
        new_blocks = self.blocks_for(len(all_tokens)) - len(table.blocks)
        if new_blocks > self.num_free:
            raise PoolExhausted(f"{new_blocks} more blocks for the sequence, {self.num_free} free")
        first_full, table.num_tokens = table.num_tokens // self.block_size, len(all_tokens)
        table.blocks.extend(self._take().id for _ in range(new_blocks))
        previous = self.blocks[table.blocks[first_full - 1]].hash if first_full else None
        if first_full and previous is None:  # the chain is broken (prefixes forgotten): register nothing
            return
        for i in range(first_full, len(all_tokens) // self.block_size):
            tokens = all_tokens[i * self.block_size : (i + 1) * self.block_size]
            previous = chain_hash(previous, tokens)
            block = self.blocks[table.blocks[i]]
            if block.hash is None and block.ref_count == 1:  # a block of its own: now full, now findable
                self._register(block, previous, tokens)

    def blocks_to_reserve(self, table: BlockTable, num_positions: int) -> int:
        """Blocks ``reserve(table, num_positions)`` would take."""
        return max(0, self.blocks_for(num_positions) - len(table.blocks))

    def reserve(self, table: BlockTable, num_positions: int) -> None:
        """Blocks for the first ``num_positions`` positions, taken ahead of the tokens that will fill them (the
        decode steps before the next host sync); ``record`` hashes them once their tokens are known."""
        new_blocks = self.blocks_to_reserve(table, num_positions)
        if new_blocks > self.num_free:
            raise PoolExhausted(f"{new_blocks} more blocks for the sequence, {self.num_free} free")
        table.blocks.extend(self._take().id for _ in range(new_blocks))

    def record(self, table: BlockTable, all_tokens: Sequence[int], written: int) -> None:
        """The sequence now holds ``all_tokens`` (its blocks reserved), of which the first ``written`` have K and V
        in the cache: blocks full of written positions are hashed, so later sequences can find them."""
        table.num_tokens = len(all_tokens)
        end = min(written, len(all_tokens), len(table.blocks) * self.block_size) // self.block_size
        while 0 <= table.hashed < end:
            i = table.hashed
            previous = self.blocks[table.blocks[i - 1]].hash if i else None
            block = self.blocks[table.blocks[i]]
            if (i and previous is None) or block.hash is not None or block.ref_count != 1:
                table.hashed = -1  # the chain is broken (forgotten, or not its own block): stop hashing
                return
            tokens = all_tokens[i * self.block_size : (i + 1) * self.block_size]
            self._register(block, chain_hash(previous, tokens), tokens)
            table.hashed = i + 1

    def free(self, table: BlockTable) -> None:
        """Give back the sequence's blocks (a block returns to the pool when no sequence holds it)."""
        for block_id in reversed(table.blocks):  # the tail first: a prefix's head stays cached longest
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than held"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        table.blocks, table.num_tokens = [], 0

    def forget_prefixes(self) -> None:
        """Drop every prefix hash (the weights changed: cached K and V are stale); held blocks stay held."""
        self.by_hash.clear()
        for block in self.blocks:
            block.hash, block.tokens = None, ()

    def _full_chunks(self, token_ids: Sequence[int]) -> list[Sequence[int]]:
        size = self.block_size
        return [token_ids[i : i + size] for i in range(0, len(token_ids) - size + 1, size)]

    def _leading_cached(self, token_ids: Sequence[int]) -> list[Block]:
        """The cached blocks holding ``token_ids``' leading full blocks, up to the first that is not cached."""
        found, previous = [], None
        for tokens in self._full_chunks(token_ids):
            previous = chain_hash(previous, tokens)
            block = self._cached(previous, tokens)
            if block is None:
                break
            found.append(block)
        return found

    def _cached(self, prefix_hash: int, tokens: Sequence[int]) -> Block | None:
        block_id = self.by_hash.get(prefix_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.tokens == tuple(tokens) else None  # equal hashes, different tokens: a collision

    def _hold(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.id]  # a cached free block comes back into use
        block.ref_count += 1
        self.stats.peak_used = max(self.stats.peak_used, self.num_used)

    def _take(self) -> Block:
        """The least recently freed block, its old prefix forgotten."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.by_hash.get(block.hash) == block_id:
            del self.by_hash[block.hash]
        block.hash, block.tokens, block.ref_count = None, (), 1
        self.stats.peak_used = max(self.stats.peak_used, self.num_used)
        return block

    def _register(self, block: Block, prefix_hash: int, tokens: Sequence[int]) -> None:
        block.hash, block.tokens = prefix_hash, tuple(tokens)
        self.by_hash.setdefault(prefix_hash, block.id)
