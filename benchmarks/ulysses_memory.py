"""Bytes saved for backward per rank under Ulysses sequence parallelism, sp = 1, 2, 4 (CPU, gloo processes).

    python benchmarks/ulysses_memory.py                  # one 4096-token sequence, sp = 1 2 4
    python benchmarks/ulysses_memory.py --tokens 8192 --sp 1 2

For each sp, sp processes form one sequence-parallel group (FSDP2 over them) and score one packed sequence
of ``--tokens`` tokens (the last ``--response`` of them the response) with the actor's training forward,
log-probs and entropy, as an update does. Every tensor autograd saves for backward passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook, which counts the bytes of its storage once (views of
one storage count once) and leaves out the parameters (FSDP2's gathered copies, the same at every sp).
The figure is the most any rank saved, against sp=1; then one backward runs to show the step completes.
The model is Llama-shaped, GQA with 2 KV heads (replicated at sp = 4), small enough for 4k tokens on a CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp

from hybridflow.utils.dist import free_port

logger = logging.getLogger("ulysses_memory")

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=768,
    max_position_embeddings=16384,
)


def one_sequence(tokens: int, response: int) -> dict[str, torch.Tensor]:
    """A batch of one sequence: ``tokens - response`` prompt tokens, then ``response`` response tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, MODEL["vocab_size"], (1, tokens), generator=g)  # (1, T)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(tokens)[None]}


def saved_bytes(fn) -> tuple[object, int]:
    """Run ``fn()`` counting the bytes of every storage autograd saves (once each), parameters left out."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if isinstance(t, torch.nn.Parameter):
            return t
        inner = getattr(t, "elem", t)  # a collective's wrapper (AsyncCollectiveTensor) holds its result
        try:
            storage = inner.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass without a storage of its own
            key, nbytes = id(inner), inner.numel() * inner.element_size()
        if key not in seen:
            seen.add(key)
            total += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def measure(rank: int, sp: int, tokens: int, response: int) -> dict[str, float]:
    """This rank's saved bytes and times for one forward and backward at sequence-parallel size ``sp``."""
    from hybridflow.config.schema import ActorConfig
    from hybridflow.engine.ops.packing import build_scoring_inputs
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.models import build_tiny_model

    lm = build_tiny_model("llama", **MODEL, seed=1)
    engine = ActorEngine(lm, ActorConfig(), use_remove_padding=True, dims=ParallelDims(sp, sp=sp))
    batch = one_sequence(tokens, response)
    inputs = build_scoring_inputs(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], response, True
    )
    engine.module.train()
    start = time.perf_counter()
    (logp, ent), nbytes = saved_bytes(lambda: engine.module(inputs, 1.0, True))
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    (logp.sum() + 0.01 * ent.sum()).backward()
    backward_s = time.perf_counter() - start
    return {"saved_bytes": nbytes, "forward_s": forward_s, "backward_s": backward_s, "scored": logp.numel()}


def _entry(rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        queue.put((rank, measure(rank, *args)))
    except Exception as error:  # the parent stops instead of waiting for a result that never comes
        queue.put((rank, error))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(sp: int, tokens: int, response: int) -> list[dict[str, float]]:
    """``measure`` on ``sp`` spawned gloo processes; their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, sp, port, (sp, tokens, response), queue)) for r in range(sp)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, result = queue.get()
        if isinstance(result, Exception):
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed") from result
        results[rank] = result
    for p in procs:
        p.join()
    return [results[r] for r in range(sp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="length of the one packed sequence")
    parser.add_argument("--response", type=int, default=512, help="scored (response) tokens at its end")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel sizes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("model %s; one sequence of %d tokens, %d scored", MODEL, args.tokens, args.response)
    logger.info("| sp | saved for backward per rank (MiB, max over ranks) | vs sp=1 | 1/sp | fwd s | bwd s |")
    logger.info("|---|---|---|---|---|---|")
    base = None
    for sp in args.sp:
        ranks = run_group(sp, args.tokens, args.response)
        assert sum(r["scored"] for r in ranks) == sp * args.response  # every rank has the whole sequence's
        most = max(r["saved_bytes"] for r in ranks)
        base = most if sp == 1 else base
        logger.info(
            "| %d | %.1f | %.3f | %.3f | %.2f | %.2f |",
            sp,
            most / 2**20,
            most / base if base else float("nan"),
            1 / sp,
            max(r["forward_s"] for r in ranks),
            max(r["backward_s"] for r in ranks),
        )


if __name__ == "__main__":
    main()
