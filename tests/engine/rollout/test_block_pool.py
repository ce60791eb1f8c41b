"""The paged KV cache's block pool (issue 41, first part): sharing by fork and by prefix hash, copy-on-write of
a partly filled block, growth, exhaustion, and every block back in the pool at the end. A shadow "device"
(each block's written tokens) checks that every sequence's blocks always hold exactly its tokens."""

from __future__ import annotations

import random

import pytest

from hybridflow.engine.rollout import block_pool
from hybridflow.engine.rollout.block_pool import BlockPool, BlockTable, PoolExhausted


class Device:
    """What a KV cache would hold: the token at each position of each block, written as the engine would."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.content = pool, {b.id: [] for b in pool.blocks}

    def allocate(self, tokens: list[int]) -> BlockTable:
        table = self.pool.allocate(tokens)
        size = self.pool.block_size
        for i, block in enumerate(table.blocks):
            chunk = tokens[i * size : (i + 1) * size]
            if i * size < table.cached_tokens:  # found cached: the device must already hold these tokens
                assert self.content[block] == chunk
            else:  # prefilled
                self.content[block] = list(chunk)
        return table

    def fork(self, table: BlockTable) -> BlockTable:
        out, copy = self.pool.fork(table)
        if copy is not None:
            self.content[copy[1]] = list(self.content[copy[0]])
        return out

    def append(self, table: BlockTable, tokens: list[int], new: list[int]) -> None:
        size, start = self.pool.block_size, table.num_tokens
        self.pool.append(table, new, tokens + new)
        for j, token in enumerate(new):
            position = start + j
            block = self.content[table.blocks[position // size]]
            del block[position % size :]  # a reused block's stale tail goes
            block.append(token)

    def check(self, table: BlockTable, tokens: list[int]) -> None:
        held = [t for block in table.blocks for t in self.content[block]]
        assert held[: len(tokens)] == tokens and table.num_tokens == len(tokens)


def test_the_samples_of_prompts_share_full_blocks_and_copy_the_last_partial_one() -> None:
    pool = BlockPool(num_blocks=64, block_size=4)
    device = Device(pool)
    prompts = [
        list(range(10, 19)),
        list(range(30, 34)),
        [7, 8],
    ]  # 9 tokens (2 full + 1), 4 (1 full), 2 (partial)
    groups = []
    for prompt in prompts:
        first = device.allocate(prompt)
        samples = [first] + [device.fork(first) for _ in range(3)]  # n = 4
        groups.append((prompt, samples))
    assert (
        pool.blocks[groups[0][1][0].blocks[0]].ref_count == 4
    )  # a full prompt block: one copy for 4 samples
    partial = {s.blocks[-1] for s in groups[0][1]}
    assert len(partial) == 4  # the partly filled block: one each, so the samples may diverge
    for g, (prompt, samples) in enumerate(groups):
        for k, table in enumerate(samples):  # different lengths and tokens per sample
            generated = [100 + 10 * g + k] * (k * 3 + 1)
            device.append(table, prompt, generated)
            device.check(table, prompt + generated)
    assert pool.stats.forked_blocks == 3 * 2 + 3 * 1 + 0
    for _, samples in groups:
        for table in samples:
            pool.free(table)
    assert pool.num_free == 64 and all(b.ref_count == 0 for b in pool.blocks)


def test_a_later_request_and_a_multi_turn_continuation_reuse_the_cached_prefix() -> None:
    pool = BlockPool(num_blocks=32, block_size=4)
    device = Device(pool)
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks every request starts with
    a = device.allocate([*system, 20, 21, 22])
    b = device.allocate([*system, 30, 31, 32, 33, 34])
    assert (a.cached_tokens, b.cached_tokens) == (0, 8) and a.blocks[:2] == b.blocks[:2]
    turn1 = [*system, 30, 31, 32, 33, 34]
    answer = [40, 41, 42, 43, 44, 45]
    device.append(b, turn1, answer)  # generation fills blocks 2 and 3: they become findable
    pool.free(b)  # the episode's first turn ends; its blocks stay cached while free
    turn2 = turn1 + answer + [50, 51]  # the next turn: the whole conversation again, then the new message
    c = device.allocate(turn2)
    assert c.cached_tokens == 16  # 4 full blocks found, the 4th filled by the generated answer
    device.check(c, turn2)
    assert pool.stats.hit_rate == pytest.approx((0 + 2 + 4) / (2 + 3 + 5))  # hits / full blocks looked up
    for table in (a, c):
        pool.free(table)
    assert pool.num_free == 32


def test_a_hash_collision_never_shares_another_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_pool, "chain_hash", lambda previous, tokens: 0)  # every block collides
    pool = BlockPool(num_blocks=8, block_size=2)
    device = Device(pool)
    a = device.allocate([1, 2, 3, 4])
    b = device.allocate([5, 6, 7, 8])
    assert b.cached_tokens == 0 and not set(a.blocks) & set(b.blocks)
    device.check(b, [5, 6, 7, 8])


def test_an_exhausted_pool_refuses_then_serves_once_blocks_come_back() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    held = pool.allocate(list(range(12)))  # 3 blocks
    assert not pool.can_allocate(list(range(100, 108)))
    with pytest.raises(PoolExhausted, match="2 blocks for 8 tokens, 1 free"):
        pool.allocate(list(range(100, 108)))
    assert pool.can_allocate(list(range(8)))  # its 2 blocks are cached and held: nothing new to take
    shared = pool.allocate([*list(range(8)), 99])
    assert shared.cached_tokens == 8 and pool.num_free == 0
    with pytest.raises(PoolExhausted):
        pool.append(shared, [1, 2, 3, 4], [*list(range(8)), 99, 1, 2, 3, 4])
    pool.free(held)
    pool.free(shared)
    assert pool.num_free == 4 and pool.stats.peak_used == 4
    revived = pool.allocate(list(range(12)))  # the freed prefix is still cached: found, not prefilled
    assert revived.cached_tokens == 12
    pool.free(revived)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_keeps_every_sequence_intact_and_returns_every_block(seed: int) -> None:
    """Allocate (prompts with shared heads), fork, grow, finish, in a random order, on a pool that runs short."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=40, block_size=3)
    device = Device(pool)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(0, 7))] for _ in range(3)]
    live: list[tuple[BlockTable, list[int]]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            if pool.can_allocate(tokens):
                live.append((device.allocate(tokens), tokens))
        elif op < 0.45 and live:
            table, tokens = rng.choice(live)
            if pool.num_free:
                live.append((device.fork(table), list(tokens)))
        elif op < 0.8 and live:
            i = rng.randrange(len(live))
            table, tokens = live[i]
            new = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
            if pool.blocks_for(len(tokens) + len(new)) - len(table.blocks) <= pool.num_free:
                device.append(table, tokens, new)
                live[i] = (table, tokens + new)
        elif live:
            table, _ = live.pop(rng.randrange(len(live)))
            pool.free(table)
        holders: dict[int, int] = {}
        for table, tokens in live:
            device.check(table, tokens)
            for block in table.blocks:
                holders[block] = holders.get(block, 0) + 1
        assert all(pool.blocks[b].ref_count == n for b, n in holders.items())
        assert pool.num_free == len(pool.blocks) - len(holders)
    assert pool.stats.hit_blocks > 0 and pool.stats.forked_blocks > 0
    for table, _ in live:
        pool.free(table)
    assert pool.num_free == 40 and all(b.ref_count == 0 for b in pool.blocks)


def test_reserve_ahead_then_record_hashes_only_written_full_blocks() -> None:
    """The device path takes the blocks of the next decode steps ahead of their tokens; a block is hashed
    (findable by a later request) only once all its positions are written."""
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    table = pool.allocate(tokens)  # one full block (hashed), one partial
    assert (len(table.blocks), table.hashed) == (2, 1)
    assert pool.blocks_to_reserve(table, 6 + 5) == 1
    pool.reserve(table, 6 + 5)  # five decode steps ahead: positions up to 10
    assert len(table.blocks) == 3 and pool.num_free == 5
    tokens += [7, 8, 9]
    pool.record(table, tokens, written=7)  # position 7 (token 8) not yet written: block 1 not hashed
    assert table.hashed == 1 and table.num_tokens == 9
    pool.record(table, tokens, written=8)
    assert table.hashed == 2
    assert pool.allocate([1, 2, 3, 4, 5, 6, 7, 8, 0]).cached_tokens == 8  # a later request finds both
    with pytest.raises(PoolExhausted):
        pool.reserve(table, 4 * 20)
