"""Training views on CPU (gloo): tensor parallelism inside the layers and pipeline stages across them,
composed with FSDP2 over dp, give the log-probs, the loss, the grad norm and the updated weights of one rank
on the same fixed batch, for the actor and the critic (tiny Qwen2 with tied embeddings and Llama untied,
both GQA; prompts and responses of different lengths, micro-batches of different token counts); a
checkpoint of one view loads into others and exports."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, rollout_batch
from support.dist_util import run_world

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

pytestmark = pytest.mark.slow

R, B = 6, 8  # response width, samples
PROMPT_LENGTHS = [7, 4, 6, 2, 7, 5, 1, 6]  # left-padded to 7
RESPONSE_LENGTHS = [6, 2, 0, 4, 6, 1, 3, 5]


def fixed_batch(seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of different lengths, one response fully masked."""
    return rollout_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, R, seed, advantages=NORMAL)


def actor_config() -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = B  # one mini-batch: one optimizer step
    cfg.ppo_micro_batch_size_per_gpu = 3  # gradient accumulation over uneven micro-batches
    cfg.entropy_coeff = 0.01
    cfg.grad_clip = 0.5  # clipping is on: the global norm must be the same in every view
    cfg.optim.lr = 1e-2
    # Adam's first step is lr * g / (|g| + eps): with the default eps, a gradient that is zero in exact
    # arithmetic (k_proj's bias: softmax ignores a shift shared by every key) moves by +-lr on its rounding
    # noise alone. A larger eps keeps the step linear in small gradients, so the weights compare at 1e-6.
    cfg.optim.eps = 1e-3
    return cfg


def train_in_view(rank: int, world: int, views: list[tuple[str, int, int, bool]]) -> list[dict]:
    """Per (arch, tp, pp, remove_padding): log-probs, one update's metrics, and the updated full weights."""
    from hybridflow.engine.hybrid.switch import held_box
    from hybridflow.engine.parallel.dims import ParallelDims, train_box
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.parallel.layout import kind_of
    from hybridflow.engine.parallel.pipeline import stage_of_param
    from hybridflow.engine.roles.actor import ActorEngine

    out = []
    for arch, tp, pp, packed in views:
        lm = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=1)
        view = ParallelDims(world, tp, pp)
        engine = ActorEngine(lm, actor_config(), use_remove_padding=packed, dims=view)
        dp_rank, dp = view.coords(rank)[2], view.dp
        batch = fixed_batch()[list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))]  # its replica's rows
        logp = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"]
        batch["old_log_probs"] = logp - 0.05
        metrics = engine.update_policy(batch)
        state = full_state_dict(engine.module, engine.engine.pp_group)
        state = {k: v.clone() for k, v in state.items()}  # one rank's may alias the live weights
        out.append({"log_probs": logp, "metrics": metrics, "state": state if rank == 0 else None})
        for name, param in engine.module.named_parameters():  # the plans' boxes are the DTensors' own
            stages = stage_of_param(name, 4, pp, arch == "qwen2")  # the tiny Qwen2 ties its head
            assert held_box(param) == train_box(kind_of(name), tuple(param.shape), view, rank, 0, stages), (
                name
            )
        if arch == "qwen2":
            out[-1]["sft"] = engine.update_sft(batch)  # one SFT step more, from the updated weights
            out[-1]["critic"] = critic_in_view(batch, view)
    return out


def critic_in_view(batch: Batch, view) -> dict:
    """The critic in the same view: values, one update's metrics, the updated weights (rank 0)."""
    from hybridflow.config.schema import CriticConfig
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.critic import CriticEngine
    from hybridflow.models import build_value_model

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=3)
    cfg = CriticConfig()
    cfg.ppo_micro_batch_size_per_gpu = 3
    cfg.optim.lr = 1e-2
    cfg.optim.eps = 1e-3  # as actor_config's: Adam's first step stays linear in rounding-noise gradients
    engine = CriticEngine(build_value_model(lm, head_seed=1), cfg, ppo_mini_batch_size=B, dims=view)
    batch = batch[list(range(len(batch)))]  # a copy: the actor's batch keeps its fields
    values = engine.compute_values(batch)
    batch["values"] = values
    batch["returns"] = (0.5 - values) * batch["response_mask"]  # per row: the same on any share of the rows
    metrics = engine.update_critic(batch)
    state = full_state_dict(engine.module, engine.engine.pp_group)
    return {"values": values, "metrics": metrics, "state": state}


VIEWS = [("qwen2", 1, 1, True), ("llama", 1, 1, False)]


@pytest.fixture(scope="module")
def one_rank() -> list[dict]:
    return run_world(1, train_in_view, 1, VIEWS)[0]


def assert_same(got: dict, want: dict, dp: int) -> None:
    torch.testing.assert_close(got["log_probs"], want["log_probs"][: B // dp], rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert got["state"].keys() == want["state"].keys()
    for key in want.get("sft", {}):
        assert got["sft"][key] == pytest.approx(want["sft"][key], rel=1e-5, abs=1e-6), key
    if "critic" in want:
        torch.testing.assert_close(
            got["critic"]["values"], want["critic"]["values"][: B // dp], rtol=0, atol=1e-5
        )
        for key, value in want["critic"]["metrics"].items():
            assert got["critic"]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        for name, tensor in want["critic"]["state"].items():
            torch.testing.assert_close(got["critic"]["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


# (world, tp, pp) of each view, the views of one world size run in one set of processes.
VIEWS_BY_WORLD = {2: [(2, 1), (1, 2)], 4: [(2, 2), (2, 1)]}


@pytest.mark.parametrize("world", sorted(VIEWS_BY_WORLD))
def test_tensor_and_pipeline_parallel_training_equals_one_rank(one_rank: list[dict], world: int) -> None:
    """tp=2 and pp=2 on 2 ranks; tp=2 x pp=2 and tp=2 x dp=2 on 4 (actor and critic, Qwen2 tied + Llama)."""
    sizes = VIEWS_BY_WORLD[world]
    views = [(arch, tp, pp, packed) for tp, pp in sizes for arch, _, _, packed in VIEWS]
    results = run_world(world, train_in_view, world, views, timeout=600)
    for i, (tp, pp) in enumerate(sizes):
        for j, want in enumerate(one_rank):
            assert_same(results[0][i * len(VIEWS) + j], want, world // (tp * pp))


def test_qwen3_tensor_parallel_training_equals_one_rank() -> None:
    """Qwen3's per-head q/k norms (replicated under tp) through a whole update at tp=2, against one rank."""
    view = [("qwen3", 1, 1, True)]
    (want,) = run_world(1, train_in_view, 1, view)[0]
    (got,) = run_world(2, train_in_view, 2, [("qwen3", 2, 1, True)], timeout=600)[0]
    assert_same(got, want, 1)
    assert any("q_norm" in name for name in want["state"])  # the family's own weights were compared


def save_in_view(rank: int, run_dir: str, tp: int, pp: int) -> torch.Tensor:
    """One update in the view (tp, pp) over tp x pp ranks, a checkpoint (and its export config), then the
    log-probs."""
    from pathlib import Path

    from hybridflow.checkpoint import RoleState, save, write_hf_config
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.roles.actor import ActorEngine

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=1)
    engine = ActorEngine(lm, actor_config(), use_remove_padding=True, dims=ParallelDims(tp * pp, tp, pp))
    batch = fixed_batch()  # one replica: every rank trains on every row
    batch["old_log_probs"] = engine.compute_log_prob(batch)["log_probs"] - 0.05
    engine.update_policy(batch)
    save(run_dir, 1, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")}, {}, {})
    if rank == 0:  # the whole model's config: the stage's own lists every layer too
        write_hf_config(Path(run_dir) / "global_step_1" / "actor" / "hf_config", engine.module.lm, None)
    return engine.compute_log_prob(fixed_batch())["log_probs"]


def load_in_view(rank: int, ckpt: str, world: int, tp: int, pp: int = 1) -> torch.Tensor:
    """A fresh engine (other initial weights) in another view, loaded from the checkpoint: its log-probs."""
    from hybridflow.checkpoint import RoleState, load
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.roles.actor import ActorEngine

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=7)
    engine = ActorEngine(lm, actor_config(), use_remove_padding=True, dims=ParallelDims(world, tp, pp))
    load(ckpt, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")})
    return engine.compute_log_prob(fixed_batch())["log_probs"]


def exported_log_probs(rank: int, model_dir: str) -> torch.Tensor:
    """The exported directory through AutoModelForCausalLM, scored by a one-rank engine."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.roles.actor import ActorEngine

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return ActorEngine(lm, actor_config(), trainable=False).compute_log_prob(fixed_batch())["log_probs"]


def load_at_one_rank_and_export(rank: int, run_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """At one rank: load the checkpoint into an engine, and export it as a Hugging Face directory."""
    from hybridflow.checkpoint import export_hf

    ckpt = f"{run_dir}/global_step_1"
    at_one = load_in_view(rank, ckpt, 1, 1)
    export_hf(ckpt, f"{run_dir}/hf")
    return at_one, exported_log_probs(rank, f"{run_dir}/hf")


def test_a_checkpoint_of_the_tensor_and_pipeline_parallel_view_loads_in_other_views_and_exports(
    tmp_path,
) -> None:
    """Saved at tp=2 x pp=2 (4 ranks); loaded at fsdp=2 and at one rank; exported (tied Qwen2)."""
    saved = run_world(4, save_in_view, str(tmp_path), 2, 2, timeout=600)[0]
    at_fsdp2 = run_world(2, load_in_view, f"{tmp_path}/global_step_1", 2, 1)[0]
    at_one, exported = run_world(1, load_at_one_rank_and_export, str(tmp_path))[0]
    for got in (at_fsdp2, at_one, exported):
        torch.testing.assert_close(got, saved, rtol=0, atol=1e-5)
