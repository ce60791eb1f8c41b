"""Sharded checkpoints of a real FSDP2 actor: resharding across world sizes, refusals, optimizer state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.batches import Draw, rollout_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.checkpoint import CheckpointError, RoleState, load, read_meta, save
from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

R, B = 4, 8  # response length, samples


def fixed_batch() -> Batch:
    """Prompts and responses of varied lengths, with advantages and old log-probs for an update."""
    return rollout_batch(
        [5, 3, 4, 5, 2, 4, 5, 3],  # prompt lengths (left-padded to 5)
        [4, 3, 1, 2, 4, 3, 4, 2],  # response lengths
        R,
        seed=3,
        advantages=Draw(),  # N(0, 1) on every column, past the responses' ends too
        old_log_probs=Draw(-4.0, -3.0),
    )


def make_engine(hidden: int = 32, seed: int = 1):
    from hybridflow.engine.roles.actor import ActorEngine

    cfg = ActorConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu = B, 4
    cfg.optim.lr = 1e-2
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=hidden, num_hidden_layers=2, seed=seed)
    return ActorEngine(lm, cfg)


def my_rows(rank: int, world: int) -> Batch:
    return fixed_batch()[list(range(rank * B // world, (rank + 1) * B // world))]


def log_probs_and_next_update(engine, rank: int, world: int) -> dict:
    """Log-probs of the whole fixed batch, then one more update on this rank's rows, then the weights."""
    from hybridflow.engine.parallel.fsdp import full_state_dict

    logps = engine.compute_log_prob(fixed_batch(), micro_batch_size=4)["log_probs"]
    engine.update_policy(my_rows(rank, world))
    return {"log_probs": logps, "state": full_state_dict(engine.module)}


def save_after_update(rank: int, run_dir: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    engine = make_engine()
    engine.update_policy(my_rows(rank, world))  # the optimizer has state now
    role = RoleState(engine.module, engine.engine.optimizer, "lm.")
    save(run_dir, 1, {"actor": role}, {"note": "hi"}, {"world_size": world})
    return log_probs_and_next_update(engine, rank, world)


def load_into_fresh(rank: int, ckpt: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    engine = make_engine(seed=7)  # different initial weights: everything must come from the checkpoint
    state = load(ckpt, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")})
    assert state == {"note": "hi"}
    return log_probs_and_next_update(engine, rank, world)


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_checkpoint_reshards_between_world_sizes(tmp_path: Path, save_world: int, load_world: int) -> None:
    saved = run_world(save_world, save_after_update, str(tmp_path))[0]
    meta = read_meta(tmp_path / "global_step_1")
    assert meta["world_size"] == save_world and meta["roles"]["actor"]["optimizer"] is True
    loaded = run_world(load_world, load_into_fresh, str(tmp_path / "global_step_1"))[0]
    torch.testing.assert_close(loaded["log_probs"], saved["log_probs"], rtol=0, atol=1e-6)
    # The next update agrees too, so the Adam moments and step count came back resharded.
    for name, tensor in saved["state"].items():
        torch.testing.assert_close(loaded["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def refuse_other_model(rank: int, run_dir: str) -> str:
    engine = make_engine()
    save(run_dir, 2, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")}, {}, {})
    # never stepped, but the engine allocated AdamW's state (zero moments at step 0), so it is saved
    assert read_meta(Path(run_dir) / "global_step_2")["roles"]["actor"]["optimizer"] is True
    wider = make_engine(hidden=48)
    with pytest.raises(CheckpointError) as err:
        load(Path(run_dir) / "global_step_2", {"actor": RoleState(wider.module, wider.engine.optimizer)})
    with pytest.raises(CheckpointError, match="has no critic"):
        load(Path(run_dir) / "global_step_2", {"critic": RoleState(wider.module)})
    return str(err.value)


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    (message,) = run_world(1, refuse_other_model, str(tmp_path))
    assert "does not match this model" in message
    assert "lm.model.embed_tokens.weight: checkpoint (64, 32) vs model (64, 48)" in message


def test_an_incomplete_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "global_step_3").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        read_meta(tmp_path / "global_step_3")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_meta(tmp_path / "global_step_9")


def weights_only_into_a_stepped_optimizer(rank: int, run_dir: str) -> tuple[list[float], float]:
    engine = make_engine()
    save(run_dir, 3, {"actor": RoleState(engine.module, None, "lm.")}, {}, {})
    assert read_meta(Path(run_dir) / "global_step_3")["roles"]["actor"]["optimizer"] is False
    engine.update_policy(my_rows(0, 1))  # moments and step counts move
    optimizer = engine.engine.optimizer
    load(Path(run_dir) / "global_step_3", {"actor": RoleState(engine.module, optimizer, "lm.")})
    states = list(optimizer.state.values())
    moments = [s[k].to_local() for s in states for k in ("exp_avg", "exp_avg_sq")]
    return [float(s["step"]) for s in states], max(float(m.abs().max()) for m in moments)


def test_a_checkpoint_without_optimizer_state_resets_the_moments(tmp_path: Path) -> None:
    # The saved run had not stepped: the loading optimizer keeps its allocated state, back at zero.
    ((steps, largest),) = run_world(1, weights_only_into_a_stepped_optimizer, str(tmp_path))
    assert steps and set(steps) == {0.0}
    assert largest == 0.0
