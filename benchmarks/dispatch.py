"""What one call of a role costs the driver on 4 CPU processes (gloo): the data's way to the ranks and back.

    PYTHONPATH=$PWD python benchmarks/dispatch.py                 # actor and reference tp=2 (dp=2), critic dp=4
    PYTHONPATH=$PWD python benchmarks/dispatch.py --view sp       # actor and reference Ulysses sp=2 (dp=2)
    PYTHONPATH=$PWD python benchmarks/dispatch.py --view pp       # actor and reference pp=2 (dp=2)

Four processes run the driver as torchrun would (the local backend: every process is a rank and runs the
same driver code), with a tiny model (hidden 32, 2 layers) so that moving the batch weighs as much as
computing on it. The batch looks like a real step's: ``--samples`` (64) samples whose prompts run from 8
to ~300 tokens and whose responses end anywhere up to 256 tokens, with the fields each call reads
(advantages, old and reference log-probs, values, returns). Each call runs ``--warmup`` times, then
``--repeats`` times behind a barrier; the table gives rank 0's median wall time per call in milliseconds
(every rank waits for the others inside a call, so rank 0's time is the call's). The critic keeps FSDP2
over all four ranks (dp=4) while the actor and the reference have replicas of two ranks (dp=2).

``--dispatch-only`` replaces the engines' passes (``ActorEngine.compute_log_prob`` / ``update_policy``,
``CriticEngine.compute_values`` / ``update_critic``) with ones that return zeros of the right shapes at once,
so that what is left of a call is the data's way: the driver's split, whatever the replica's ranks exchange,
the results' way back and the merge. On a shared machine the full calls vary by more than that costs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp

WORLD = 4
VIEWS = {  # verl's spellings, which every version of the config takes
    "tp": ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
    "pp": ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
    "sp": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true"],
}


def overrides(model_dir: str, view: str, samples: int) -> list[str]:
    """The run's config: GAE with a critic and a KL loss (reference), one optimizer step per update."""
    prompts = samples // 2
    return [
        f"model.path={model_dir}",
        f"trainer.n_gpus_per_node={WORLD}",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.total_training_steps=1",
        "algorithm.adv_estimator=gae",
        "actor.use_kl_loss=true",
        "rollout.n=2",
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}",
        "data.max_prompt_length=320",
        "data.max_response_length=256",
        "actor.ppo_micro_batch_size_per_gpu=16",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "rollout.log_prob_micro_batch_size_per_gpu=16",
        "ref.log_prob_micro_batch_size_per_gpu=16",
        *VIEWS[view],
    ]


def step_batch(samples: int, pad_id: int, vocab: int, seed: int = 0) -> Any:
    """A step's batch after the advantages: varied prompt and response lengths, every field the calls read."""
    from hybridflow.engine import pack_prompt_response

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 300))] for _ in range(samples // 2)]
    prompts = [p for p in prompts for _ in range(2)]  # two samples per prompt, interleaved
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 256))] for _ in range(samples)]
    batch = pack_prompt_response(prompts, responses, 256, pad_id)
    mask = batch["response_mask"].float()  # (B, R)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = -torch.rand(mask.shape, generator=g) * 3 * mask
    batch["ref_log_prob"] = batch["old_log_probs"] + 0.01 * mask
    batch["values"] = torch.randn(mask.shape, generator=g) * mask
    batch["returns"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def skip_compute() -> None:
    """The engines' passes return zeros of their outputs' shapes at once (``--dispatch-only``)."""
    from hybridflow.engine import ActorEngine, CriticEngine

    def zeros(batch: Any) -> torch.Tensor:
        return torch.zeros(batch["responses"].shape)  # (B, R)

    ActorEngine.compute_log_prob = lambda self, batch, **kw: {
        "log_probs": zeros(batch),
        "entropys": zeros(batch),
    }
    ActorEngine.update_policy = lambda self, batch, **kw: {"actor/pg_loss": 0.0}
    CriticEngine.compute_values = lambda self, batch: zeros(batch)
    CriticEngine.update_critic = lambda self, batch: {"critic/vf_loss": 0.0}


def timed(fn: Any, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup``, each started behind a barrier."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, port: int, args: argparse.Namespace, model_dir: str, out: Any) -> None:
    """One process: build the roles as the trainer does, then time each call."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from hybridflow.config import load_config
    from hybridflow.trainer.builder import build_components

    if args.dispatch_only:
        skip_compute()
    try:
        cfg = load_config(None, overrides(model_dir, args.view, args.samples))
        c = build_components(cfg)
    except Exception:
        out.put((rank, traceback.format_exc()))
        raise
    batch = step_batch(args.samples, c.pad_token_id, len(c.tokenizer))
    calls = {
        "actor.compute_log_prob": lambda: c.actor.compute_log_prob(batch),
        "ref.compute_ref_log_prob": lambda: c.ref.compute_ref_log_prob(batch),
        "critic.compute_values": lambda: c.critic.compute_values(batch),
        "actor.update_actor": lambda: c.actor.update_actor(batch),
        "critic.update_critic": lambda: c.critic.update_critic(batch),
    }
    calls = {name: fn for name, fn in calls.items() if not args.calls or name in args.calls}
    try:
        result = {name: timed(fn, args.warmup, args.repeats) for name, fn in calls.items()}
    except Exception:
        out.put((rank, traceback.format_exc()))
        raise
    c.close()
    out.put((rank, result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--view", choices=sorted(VIEWS), default="tp")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", nargs="*", help="only these calls (e.g. actor.update_actor)")
    parser.add_argument("--dispatch-only", action="store_true", help="time the data's way alone (see above)")
    args = parser.parse_args()
    from hybridflow.models import build_tiny_model_and_tokenizer
    from hybridflow.utils.dist import free_port

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_and_tokenizer(
            tmp,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=1024,
        )
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, port, args, tmp, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = {}
        for _ in range(WORLD):
            rank, result = queue.get()
            if isinstance(result, str):  # a traceback: the other ranks wait in a collective forever
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank {rank} failed:\n{result}")
            results[rank] = result
        for p in procs:
            p.join()
    import hybridflow

    what = "dispatch only" if args.dispatch_only else "whole calls"
    print(
        f"hybridflow from {Path(hybridflow.__file__).parent}; view {args.view}; {args.samples} samples; {what}"
    )
    print(f"| call | ms (median of {args.repeats}, rank 0) |")
    print("|---|---|")
    for name, seconds in results[0].items():
        print(f"| {name} | {seconds * 1e3:.0f} |")


if __name__ == "__main__":
    main()
