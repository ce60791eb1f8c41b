"""Training views on CPU (gloo): tensor parallelism inside the layers, composed with FSDP2 over dp, gives the
log-probs, the loss, the grad norm and the updated weights of one rank on the same fixed batch (tiny Qwen2
with tied embeddings and Llama untied, both GQA; prompts and responses of different lengths)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_world

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

pytestmark = pytest.mark.slow

P, R, B = 7, 6, 8  # prompt width, response width, samples


def fixed_batch(seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of different lengths, one response fully masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    for b, (pad, length) in enumerate(zip([0, 3, 1, 5, 0, 2, 6, 1], [6, 2, 0, 4, 6, 1, 3, 5])):
        mask[b, :pad] = 0
        mask[b, P + length :] = 0
    ids = ids * mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -R:],
            "response_mask": mask[:, -R:].float(),
            "advantages": torch.randn(B, R, generator=g) * mask[:, -R:],
        }
    )


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
    from hybridflow.engine.actor import ActorEngine
    from hybridflow.engine.fsdp import full_state_dict
    from hybridflow.engine.parallel.tp_rollout import kind_of
    from hybridflow.engine.parallel.train_view import TrainView, train_box
    from hybridflow.engine.reshard import held_box

    out = []
    for arch, tp, pp, packed in views:
        lm = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=1)
        view = TrainView(world, tp, pp)
        engine = ActorEngine(lm, actor_config(), use_remove_padding=packed, view=view)
        dp_rank, dp = view.coords(rank)[2], view.dp
        batch = fixed_batch()[list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))]  # its replica's rows
        logp = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"]
        batch["old_log_probs"] = logp - 0.05
        metrics = engine.update_policy(batch)
        state = full_state_dict(engine.module, engine.engine.pp_group)
        out.append({"log_probs": logp, "metrics": metrics, "state": state if rank == 0 else None})
        for name, param in engine.module.named_parameters():  # the plans' boxes are the DTensors' own
            assert held_box(param) == train_box(kind_of(name), tuple(param.shape), view, rank), name
    return out


VIEWS = [("qwen2", 1, 1, True), ("llama", 1, 1, False)]


@pytest.fixture(scope="module")
def one_rank() -> list[dict]:
    return run_world(1, train_in_view, 1, VIEWS)[0]


def assert_same(got: dict, want: dict, world: int, dp: int) -> None:
    torch.testing.assert_close(got["log_probs"], want["log_probs"][: B // dp], rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2)])
def test_tensor_parallel_training_equals_one_rank(one_rank: list[dict], world: int, tp: int) -> None:
    views = [(arch, tp, 1, packed) for arch, _, _, packed in VIEWS]
    results = run_world(world, train_in_view, world, views, timeout=600)
    for got, want in zip(results[0], one_rank):
        assert_same(got, want, world, world // tp)


def save_in_view(rank: int, run_dir: str, tp: int) -> torch.Tensor:
    """One update at tensor-parallel size ``tp``, a checkpoint (and its export config), then the log-probs."""
    from pathlib import Path

    from hybridflow.checkpoint import RoleState, save, write_hf_config
    from hybridflow.engine.actor import ActorEngine
    from hybridflow.engine.parallel.train_view import TrainView

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=1)
    engine = ActorEngine(lm, actor_config(), use_remove_padding=True, view=TrainView(2, tp))
    batch = fixed_batch()  # one replica at tp=2: both ranks train on every row
    batch["old_log_probs"] = engine.compute_log_prob(batch)["log_probs"] - 0.05
    engine.update_policy(batch)
    save(run_dir, 1, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")}, {}, {})
    if rank == 0:
        write_hf_config(Path(run_dir) / "global_step_1" / "actor" / "hf_config", engine.module.lm, None)
    return engine.compute_log_prob(fixed_batch())["log_probs"]


def load_in_view(rank: int, ckpt: str, world: int, tp: int) -> torch.Tensor:
    """A fresh engine (other initial weights) in another view, loaded from the checkpoint: its log-probs."""
    from hybridflow.checkpoint import RoleState, load
    from hybridflow.engine.actor import ActorEngine
    from hybridflow.engine.parallel.train_view import TrainView

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=4, seed=7)
    engine = ActorEngine(lm, actor_config(), use_remove_padding=True, view=TrainView(world, tp))
    load(ckpt, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")})
    return engine.compute_log_prob(fixed_batch())["log_probs"]


def exported_log_probs(rank: int, model_dir: str) -> torch.Tensor:
    """The exported directory through AutoModelForCausalLM, scored by a one-rank engine."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.actor import ActorEngine

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return ActorEngine(lm, actor_config(), trainable=False).compute_log_prob(fixed_batch())["log_probs"]


def save_then_load_at_fsdp(rank: int, run_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """In one pair of processes: save at tp=2, then load into FSDP2 over both ranks."""
    saved = save_in_view(rank, run_dir, 2)
    return saved, load_in_view(rank, f"{run_dir}/global_step_1", 2, 1)


def load_at_one_rank_and_export(rank: int, run_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """At one rank: load the checkpoint into an engine, and export it as a Hugging Face directory."""
    from hybridflow.checkpoint import export_hf

    ckpt = f"{run_dir}/global_step_1"
    at_one = load_in_view(rank, ckpt, 1, 1)
    export_hf(ckpt, f"{run_dir}/hf")
    return at_one, exported_log_probs(rank, f"{run_dir}/hf")


def test_a_checkpoint_of_the_tensor_parallel_view_loads_in_other_views_and_exports(tmp_path) -> None:
    saved, at_fsdp2 = run_world(2, save_then_load_at_fsdp, str(tmp_path))[0]
    at_one, exported = run_world(1, load_at_one_rank_and_export, str(tmp_path))[0]
    for got in (at_fsdp2, at_one, exported):
        torch.testing.assert_close(got, saved, rtol=0, atol=1e-5)
