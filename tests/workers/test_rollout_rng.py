"""Generation never touches the training RNG: torch's generators hold the same state before and after
``ActorWorker.generate`` (switch included), tensor-parallel or not, on the built-in engine and on the HF
fallback, so dropout masks, data shuffles and anything else seeded for training do not depend on rollouts.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.batches import prompt_batch
from support.dist_util import run_world_kept

from hybridflow.protocol import Batch


def prompts(rank: int) -> Batch:
    """Five left-padded prompts of 2-11 tokens (a different share on each rank)."""
    return prompt_batch([11, 2, 7, 4, 9], seed=10 + rank)


def rng_around_generate(rank: int, arch: str, overrides: list[str], cuda: bool = False) -> dict:
    """The generators' states just before and just after a seeded, sampled ``generate`` (and its tokens).

    The driver hands every rank of a rollout group the group's prompts (its ranks' shares together); the
    tokens returned are this rank's share's samples, cut from the group's as the driver's merge does.
    """
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridflow.config import load_config
    from hybridflow.engine import GenerateView
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    cfg = load_config(None, ["data.max_response_length=6", "rollout.ignore_eos=true", *overrides])
    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=5)
    worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
    params = worker.sampling_params(2, 1.0, 1.0, -1, True, [], 1234)  # the trainer's: seeded, sampled
    torch.manual_seed(99 + rank)
    before = {"cpu": torch.get_rng_state()}
    if cuda:
        before["cuda"] = torch.cuda.get_rng_state()
    view = GenerateView(cfg.trainer.world_size, cfg.rollout.tensor_model_parallel_size)
    members = view.group_ranks(view.dp_rank(rank))  # the ranks of this rank's rollout group
    together = Batch.concat([prompts(r) for r in members])
    out = worker.generate(together, params)
    share = len(out) // len(members)
    out = out[members.index(rank) * share : (members.index(rank) + 1) * share]
    after = {"cpu": torch.get_rng_state()}
    if cuda:
        after["cuda"] = torch.cuda.get_rng_state()
    return {"before": before, "after": after, "responses": out["responses"]}


def check(results: list[dict]) -> None:
    for r in results:
        assert r["before"].keys() == r["after"].keys()
        for device, state in r["before"].items():
            assert torch.equal(state, r["after"][device]), device
        rows = {tuple(row.tolist()) for row in r["responses"]}
        assert len(rows) > 5  # really sampled (ten samples, nearly all different)


@pytest.mark.parametrize("arch,engine", [("qwen2", "native"), ("qwen2", "hf"), ("gpt2", "native")])
def test_generation_leaves_the_cpu_rng_untouched_on_one_rank(arch: str, engine: str) -> None:
    check(run_world_kept(1, rng_around_generate, arch, [f"rollout.engine={engine}"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", ["rollout.tensor_model_parallel_size=2"]),  # the tensor-parallel rollout
        ("gpt2", []),  # whole HF generate replicas filled through the switch
    ],
)
def test_generation_leaves_the_cpu_rng_untouched_on_two_ranks(arch: str, overrides: list[str]) -> None:
    results = run_world_kept(2, rng_around_generate, arch, ["trainer.n_gpus_per_node=2", *overrides])
    check(results)
    if overrides:  # one rollout group: both ranks sampled the same stream, each kept its own share
        assert not torch.equal(results[0]["responses"], results[1]["responses"])


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_generation_leaves_the_cpu_and_cuda_rng_untouched_on_the_gpu(engine: str) -> None:
    check(run_world_kept(1, rng_around_generate, "qwen2", [f"rollout.engine={engine}"], True))
