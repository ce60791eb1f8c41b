"""The runner's paged path (issue 41, CPU reference): prefill and decode through block tables from the block
pool give HF ``generate``'s greedy tokens on tiny Qwen2, Qwen3 and Llama models (prompts of different lengths,
two samples sharing their prompt's blocks), and a later turn that finds its conversation's blocks cached
prefills only the new tokens and continues exactly as a run from the whole conversation."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, hf_greedy_left_padded, lively_model

from hybridflow.engine.rollout.block_pool import BlockPool, BlockTable
from hybridflow.engine.rollout.kv_cache import PagedKVCache
from hybridflow.engine.rollout.model import LlamaRunner

BLOCK = 4


class PagedGreedy:
    """A minimal greedy loop over the paged runner: what the paged engine's scheduler will do, unscheduled."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64) -> None:
        self.runner = LlamaRunner(model)
        r = self.runner
        self.pool = BlockPool(num_blocks, BLOCK)
        self.cache = PagedKVCache(r.num_layers, num_blocks, BLOCK, r.num_kv_heads, r.head_dim, r.dtype)

    def prefill(self, prompt: list[int]) -> tuple[BlockTable, int]:
        """The prompt's table and its first greedy token; cached leading blocks are not prefilled again."""
        table = self.pool.allocate(prompt)
        start = min(table.cached_tokens, len(prompt) - 1)  # the last token runs anyway: its logits
        ids = torch.tensor([prompt[start:]])
        logits = self.runner.prefill_paged(
            ids, torch.tensor([ids.shape[1]]), torch.tensor([start]), self.cache, self._tables([table])
        )
        return table, int(logits.argmax(-1))

    def generate(self, prompt: list[int], n: int, max_new: int) -> tuple[list[list[int]], list[BlockTable]]:
        first, token = self.prefill(prompt)
        tables = [first]
        for _ in range(n - 1):  # the samples share the prompt's full blocks and copy a partial one
            table, copy = self.pool.fork(first)
            if copy is not None:
                self.cache.copy_block(*copy)
            tables.append(table)
        seqs = [[*prompt, token] for _ in tables]
        for table, seq in zip(tables, seqs):
            self.pool.append(table, [token], seq)
        for _ in range(max_new - 1):
            ids = torch.tensor([seq[-1] for seq in seqs])  # (B,)
            positions = torch.tensor([len(seq) - 1 for seq in seqs])  # (B,)
            logits = self.runner.decode_paged(ids, positions, self.cache, self._tables(tables))
            for table, seq, token in zip(tables, seqs, logits.argmax(-1).tolist()):
                seq.append(token)
                self.pool.append(table, [token], seq)
        return [seq[len(prompt) :] for seq in seqs], tables

    def _tables(self, tables: list[BlockTable]) -> torch.Tensor:
        width = max(len(t.blocks) for t in tables)
        return torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t in tables])  # (B, width)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_paged_greedy_tokens_equal_hf_generate(arch: str) -> None:
    model = lively_model(arch)
    want = hf_greedy_left_padded(model, PROMPTS, 8)
    paged = PagedGreedy(model)
    for prompt, tokens in zip(PROMPTS, want):
        got, tables = paged.generate(prompt, n=2, max_new=8)
        assert got == [tokens, tokens]
        for table in tables:
            paged.pool.free(table)
    assert paged.pool.num_free == 64 and paged.pool.stats.forked_blocks > 0


def test_a_later_turn_prefills_only_what_is_not_cached_and_continues_as_a_whole_run() -> None:
    model = lively_model("qwen3")
    paged = PagedGreedy(model)
    prompt = PROMPTS[3]  # 11 tokens
    (answer,), (table,) = paged.generate(prompt, n=1, max_new=8)
    paged.pool.free(table)  # the first turn ends; its blocks stay cached
    turn2 = [*prompt, *answer, 40, 41, 42]  # the conversation so far, then the user's next message
    (again,), (table,) = paged.generate(turn2, n=1, max_new=6)
    assert table.cached_tokens == 16  # the first turn's 4 full blocks (16 of its 19 tokens): not prefilled
    want = hf_greedy_left_padded(model, [turn2], 6)[0]
    assert again == want
    paged.pool.free(table)
    assert paged.pool.num_free == 64
