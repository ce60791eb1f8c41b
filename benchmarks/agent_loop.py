"""Throughput of multi-turn episodes with a slow tool against single-turn generation of the same tokens.

    python benchmarks/agent_loop.py [--prompts 32] [--n 8] [--turns 4] [--turn-tokens 128] [--tool-tokens 32]
        [--max-response 1024] [--sleep-ms 10 100] [--workers 64] [--compile] [--out results.jsonl]
    python benchmarks/agent_loop.py --endpoint [...] (also the same episodes through the OpenAI endpoint)
    python benchmarks/agent_loop.py --tiny          (a CPU smoke run: tiny model, a few episodes)

The Qwen2.5-0.5B shape (random weights, bf16) on the paged engine (``rollout.multi_turn``'s ``AgentLoop``).
An episode's assistant turn ends at one of a set of stop tokens, drawn so that a turn runs ``--turn-tokens``
tokens on average (random weights sample nearly uniformly; the lengths vary as real turns do). The tool answers
every turn but the last (``--turns``) with ``--tool-tokens`` tokens after sleeping a random 10-100 ms (in the
loop's thread pool, as real tools run). The single-turn baseline then generates, for the same prompts, exactly
as many tokens per sample as its episode sampled (``ignore_eos``, per-sample lengths), in one ``generate`` call.
Both are timed after a warm-up run; the line printed (and appended to ``--out``) is one JSON object:
sampled tokens/s of each, their ratio, the turns and calls per episode, the tool's sleep, the prefix-cache hits
and how many engine sessions the loop went through (the engine frees its KV pool, cached prefixes included,
whenever no sequence is left: in the loop, whenever every live episode waits for its tool).

``--endpoint`` (issue 64) also plays the same episodes as a user's harness would: ``rollout.harness``'s runner
on the OpenAI-compatible endpoint over the same engine, each episode an async function on a real
``openai.AsyncOpenAI`` client sending ``/v1/completions`` with the whole text so far, sleeping 10-100 ms
(``asyncio.sleep``) for the tool and appending the tool's words. The model's words are "w0" ... "w<V-1>" (a
word-level tokenizer, so any sampled ids decode to text that encodes back to them, as the endpoint's
token-exact trajectories need), the prompts the same ids in both runs. It prints the endpoint's sampled
tokens/s beside the built-in loop's and their ratio (``endpoint_over_loop``), and the episodes' splits (0: every
turn continued its row token for token).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.engine.rollout.agent_loop import AgentLoop, Episode, LoopLimits, ToolTurn
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.session import Session

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}  # fmt: skip


class SleepyTool:
    """Answers each assistant turn but the last with ``tokens`` random tokens after sleeping 10-100 ms."""

    def __init__(self, turns: int, tokens: int, vocab: int, sleep_ms: tuple[float, float], seed: int) -> None:
        self.turns, self.tokens, self.vocab, self.sleep_ms = turns, tokens, vocab, sleep_ms
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.slept_s, self.calls = 0.0, 0

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        """The tool's tokens, or None after the episode's last turn."""
        if episode.turns >= self.turns:
            return None
        with self.lock:
            pause = self.rng.uniform(*self.sleep_ms) / 1000
            answer = [self.rng.randrange(100, self.vocab - 1) for _ in range(self.tokens)]
            self.slept_s += pause
            self.calls += 1
        time.sleep(pause)
        return ToolTurn(answer, calls=1)


class SessionTally:
    """Counts the engine's sessions and sums their prefix-cache lookups while active (a session closes, freeing
    the KV pool and its cached prefixes, whenever no sequence is left: in the loop, when every live episode
    waits for its tool)."""

    def __init__(self) -> None:
        self.sessions = self.queried = self.hits = 0

    def __enter__(self) -> SessionTally:
        self.close = Session.close
        tally = self

        def close(session: Any) -> None:
            tally.sessions += 1
            tally.queried += session.pool.stats.queried_blocks
            tally.hits += session.pool.stats.hit_blocks
            tally.close(session)

        Session.close = close
        return self

    def __exit__(self, *exc: object) -> None:
        Session.close = self.close

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits over lookups, over every session."""
        return self.hits / max(self.queried, 1)


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of ``vocab`` words "w0" ... (whitespace-split): whatever ids random weights sample
    decode to text that encodes back to the same ids, and texts joined by a space encode to the joined ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def endpoint_harness(args: argparse.Namespace, vocab: int) -> Any:
    """The workload's episode as a harness: completions of the text so far, the tool's sleep and words."""
    import asyncio

    async def episode(client: Any, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
        rng, text, used, slept, turns = random.Random(row["seed"]), row["text"], 0, 0.0, 0
        while turns < args.turns and used < args.max_response:
            out = await client.completions.create(
                model="policy", prompt=text, max_tokens=args.max_response - used
            )
            turns, used = turns + 1, used + out.usage.completion_tokens
            text += " " + out.choices[0].text
            if turns == args.turns or out.choices[0].finish_reason == "length":
                break
            pause = rng.uniform(*args.sleep_ms) / 1000
            slept += pause
            await asyncio.sleep(pause)
            words = min(args.tool_tokens, args.max_response - used)
            text += " " + " ".join(f"w{rng.randrange(100, vocab - 1)}" for _ in range(words))
            used += words
        return 0.0, {"turns": float(turns), "slept_s": slept}

    return episode


def run_endpoint(
    engine: PagedEngine,
    args: argparse.Namespace,
    prompts: list[list[int]],
    params: SamplingParams,
    vocab: int,
) -> dict[str, float]:
    """The episodes through the endpoint: sampled tokens, wall seconds, turns, splits, the tool's sleep."""
    import dataclasses

    from hybridflow.serve.driver import EngineDriver
    from hybridflow.serve.harness import HarnessRunner
    from hybridflow.serve.server import Endpoint, ServerSettings

    tokenizer = word_tokenizer(vocab)
    endpoint = Endpoint(EngineDriver(engine, tokenizer), tokenizer, [], ServerSettings()).start()
    endpoint.fixed = dataclasses.replace(params, n=1)  # as the trainer sets the run's sampling settings
    endpoint.response_budget = args.max_response
    runner = HarnessRunner(endpoint_harness(args, vocab), len(prompts) * args.n, 600.0, "zero")
    rows = [
        {"text": tokenizer.decode(p), "seed": i * args.n + j}
        for i, p in enumerate(prompts)
        for j in range(args.n)
    ]
    try:
        sync(args.device)
        start = time.perf_counter()
        results = runner.run(endpoint, rows)
        sync(args.device)
        wall = time.perf_counter() - start
    finally:
        endpoint.close()
    failed = [r.failure for r in results if r.failure is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} endpoint episodes failed ({failed[0]}): see the log")
    return {
        "sampled": sum(sum(q.mask) for r in results for q in r.sequences),
        "wall_s": wall,
        "turns": sum(r.metrics["turns"] for r in results) / len(results),
        "splits": sum(r.splits for r in results),
        "requests": sum(r.requests for r in results) / len(results),
        "slept_s": sum(r.metrics["slept_s"] for r in results) / len(results),
    }


def build_model(shape: str, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A Qwen2 model of ``shape`` with random weights (seed 0)."""
    cfg = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def stop_tokens(vocab: int, turn_tokens: int, seed: int) -> list[int]:
    """vocab / turn_tokens random ids: a turn of near-uniform samples stops after ~turn_tokens tokens."""
    return random.Random(seed).sample(range(100, vocab - 1), max(1, vocab // turn_tokens))


def sync(device: str) -> None:
    """Wait for the GPU's queued work (timing)."""
    if device == "cuda":
        torch.cuda.synchronize()


def run_episodes(
    engine: PagedEngine,
    args: argparse.Namespace,
    prompts: list[list[int]],
    params: SamplingParams,
    vocab: int,
) -> tuple[list[Episode], float, SleepyTool]:
    """One multi-turn rollout: (episodes, wall seconds, the tool)."""
    tool = SleepyTool(args.turns, args.tool_tokens, vocab, args.sleep_ms, 0)
    limits = LoopLimits(
        max_assistant_turns=args.turns, max_response_length=args.max_response, workers=args.workers
    )
    sync(args.device)
    start = time.perf_counter()
    groups = AgentLoop(engine, tool, limits).run(prompts, params)
    sync(args.device)
    return [e for g in groups for e in g], time.perf_counter() - start, tool


def run_single_turn(
    engine: PagedEngine, args: argparse.Namespace, prompts: list[list[int]], lengths: list[list[int]]
) -> tuple[int, float]:
    """Single-turn generation of ``lengths`` tokens per sample: (sampled tokens, wall seconds)."""
    params = SamplingParams(
        n=args.n, max_new_tokens=max(max(row) for row in lengths), temperature=1.0, ignore_eos=True, seed=1
    )
    sync(args.device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, lengths=lengths)
    sync(args.device)
    return sum(len(o.token_ids) for g in outputs for o in g), time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and timed runs of both; the figures as one record."""
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(args.shape, args.device, dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 1, (args.prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(
        n=args.n, max_new_tokens=args.max_response, temperature=1.0, ignore_eos=True, seed=0,
        stop_token_ids=stop_tokens(vocab, args.turn_tokens, 0),
    )  # fmt: skip
    kw: dict[str, Any] = dict(
        block_size=args.block_size,
        max_num_seqs=args.prompts * args.n,
        compile_decode=args.compile,
        max_model_len=args.prompt_len + args.max_response,  # as the actor sizes it (prompt + response)
    )
    if args.device == "cpu":
        kw["num_blocks"] = (
            args.prompts * args.n * (args.prompt_len + args.max_response) // args.block_size + 8
        )
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    engine = PagedEngine(model, **kw)
    for _ in range(args.warmup):
        run_episodes(engine, args, prompts, params, vocab)
    with SessionTally() as tally:
        episodes, multi_s, tool = run_episodes(engine, args, prompts, params, vocab)
    sampled = sum(sum(e.mask) for e in episodes)
    lengths = [
        [max(1, sum(e.mask)) for e in episodes[i * args.n : (i + 1) * args.n]] for i in range(args.prompts)
    ]
    for _ in range(args.warmup):
        run_single_turn(engine, args, prompts, lengths)
    single_tokens, single_s = run_single_turn(engine, args, prompts, lengths)
    record = {
        "benchmark": "agent_loop",
        "shape": args.shape,
        "compile_decode": args.compile,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "episodes": len(episodes),
        "num_turns/mean": sum(e.turns for e in episodes) / len(episodes),
        "tool_call_counts/mean": sum(e.tool_calls for e in episodes) / len(episodes),
        "sampled_tokens": sampled,
        "tool_tokens": sum(len(e.mask) - sum(e.mask) for e in episodes),
        "multi_turn/wall_s": multi_s,
        "multi_turn/sampled_tokens_per_s": sampled / multi_s,
        "multi_turn/prefix_cache_hit_rate": tally.hit_rate,
        "multi_turn/engine_sessions": tally.sessions,
        "tool/sleep_s_total": tool.slept_s,
        "tool/sleep_s_per_episode": tool.slept_s / len(episodes),
        "single_turn/tokens": single_tokens,
        "single_turn/wall_s": single_s,
        "single_turn/tokens_per_s": single_tokens / single_s,
        "multi_over_single": (sampled / multi_s) / (single_tokens / single_s),
    }
    if args.endpoint:
        for _ in range(args.warmup):
            run_endpoint(engine, args, prompts, params, vocab)
        via = run_endpoint(engine, args, prompts, params, vocab)
        record.update({f"endpoint/{k}": v for k, v in via.items()})
        record["endpoint/sampled_tokens_per_s"] = via["sampled"] / via["wall_s"]
        record["endpoint_over_loop"] = record["endpoint/sampled_tokens_per_s"] / (sampled / multi_s)
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--tiny`` shrinks the sizes left at their defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model and sizes")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="episodes per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--turns", type=int, default=4, help="assistant turns per episode (the tool answers all but the last)"
    )
    p.add_argument("--turn-tokens", type=int, default=128, help="mean tokens of an assistant turn")
    p.add_argument("--tool-tokens", type=int, default=32, help="tokens of each tool answer")
    p.add_argument("--max-response", type=int, default=1024, help="the response budget (tool tokens count)")
    p.add_argument("--sleep-ms", type=float, nargs=2, default=(10.0, 100.0), help="the tool's sleep range")
    p.add_argument("--workers", type=int, default=64, help="the loop's tool threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--compile", action="store_true", help="compile the decode step (rollout.compile_decode)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--endpoint", action="store_true", help="also through the OpenAI endpoint (a harness)")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line here")
    args = p.parse_args(argv)
    args.shape, args.device = ("tiny", "cpu") if args.tiny else ("0.5b", "cuda")
    if args.tiny:  # a few small episodes, unless sizes were given
        defaults = dict(prompts=32, n=8, prompt_len=128, turn_tokens=128, max_response=1024, tool_tokens=32)
        small = dict(prompts=2, n=2, prompt_len=8, turn_tokens=8, max_response=48, tool_tokens=4)
        for key, value in small.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the JSON line and a table, append it to ``--out``."""
    args = parse_args(argv)
    record = measure(args)
    print(json.dumps(record), flush=True)
    print(f"{'':24}{'multi-turn':>14}{'single-turn':>14}")
    print(f"{'sampled tokens':24}{record['sampled_tokens']:>14,}{record['single_turn/tokens']:>14,}")
    print(f"{'wall s':24}{record['multi_turn/wall_s']:>14.2f}{record['single_turn/wall_s']:>14.2f}")
    multi, single = record["multi_turn/sampled_tokens_per_s"], record["single_turn/tokens_per_s"]
    print(f"{'tokens/s':24}{multi:>14,.0f}{single:>14,.0f}   ratio {record['multi_over_single']:.2f}")
    print(
        f"turns/episode {record['num_turns/mean']:.2f}, tool calls/episode {record['tool_call_counts/mean']:.2f}, "
        f"tool sleep/episode {record['tool/sleep_s_per_episode']:.2f} s, prefix hits "
        f"{record['multi_turn/prefix_cache_hit_rate']:.2f} over {record['multi_turn/engine_sessions']} engine sessions"
    )
    if args.endpoint:
        print(
            f"endpoint: {record['endpoint/sampled_tokens_per_s']:,.0f} sampled tokens/s in "
            f"{record['endpoint/wall_s']:.2f} s ({record['endpoint_over_loop']:.2f}x the built-in loop), "
            f"turns/episode {record['endpoint/turns']:.2f}, requests/episode {record['endpoint/requests']:.2f}, "
            f"tool sleep/episode {record['endpoint/slept_s']:.2f} s, splits {record['endpoint/splits']}"
        )
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
