"""The optimizer step on the CPU (``fsdp.optimizer_step_on_cpu``): the same training as the resident AdamW.

On CPU the "host" and the "device" are one memory, but the path is the real one: the masters are a separate
float32 copy, the fused CPU AdamW steps them from the copied gradients, and the new weights are copied back
into the module's shards in the compute dtype.

The models are llama-shaped (no attention biases): a qwen2 key bias gets a gradient that is only rounding
noise (softmax ignores a shift shared by every key), which Adam scales up to steps of about lr, so any two
AdamW kernels (the CPU step's fused one, the resident foreach one) part there by ~1e-6 in three steps.
"""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, Draw, rollout_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.config import ConfigError, load_config
from hybridflow.config.schema import ActorConfig, FSDPConfig
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError

R = 6  # response length
PROMPT_LENGTHS = [7, 3, 5, 6, 2, 4, 7, 5]
RESPONSE_LENGTHS = [6, 2, 4, 0, 5, 3, 6, 1]  # row 3: an empty response; rows 0 and 6 fill the context


def actor_config(cpu_step: bool, param_dtype: str = "auto") -> ActorConfig:
    """Two-row mini-batches (one per rank of two): 8 rows give 4 optimizer steps; clipping is active."""
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_epochs = 2, 1, 1
    cfg.use_kl_loss, cfg.entropy_coeff, cfg.grad_clip = True, 0.01, 0.5
    cfg.optim.lr, cfg.optim.weight_decay = 1e-2, 0.01
    cfg.fsdp = FSDPConfig(optimizer_step_on_cpu=cpu_step, param_dtype=param_dtype)
    return cfg


def _engine(cpu_step: bool, param_dtype: str = "auto"):
    from hybridflow.engine.roles.actor import ActorEngine

    lm = build_tiny_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    return ActorEngine(lm, actor_config(cpu_step, param_dtype), rollout_n=1, use_remove_padding=True)


def _update(engine, rank: int, world: int, rows: slice = slice(0, 8), seed: int = 0) -> dict:
    """One PPO update over ``rows`` of a rollout, each rank taking its share of every mini-batch."""
    full = rollout_batch(
        PROMPT_LENGTHS, RESPONSE_LENGTHS, R, seed, advantages=NORMAL, ref_log_prob=Draw(-3, 0)
    )
    picked = list(range(8))[rows]
    share = slice(rank * 2 // world, (rank + 1) * 2 // world)
    mine = [i for m in range(0, len(picked), 2) for i in picked[m : m + 2][share]]
    batch = full[mine]
    batch["old_log_probs"] = engine.compute_log_prob(batch, micro_batch_size=2)["log_probs"] - 0.05
    return engine.update_policy(batch)


def _masters(engine) -> dict[str, torch.Tensor]:
    """The float32 weights this rank holds: the CPU step's host masters, else the resident shards."""
    train = engine.engine
    if train.cpu_step:
        return {n: train.optimizer.master(p).clone() for n, p in train.module.named_parameters()}
    return {n: p.detach().to_local().clone() for n, p in train.module.named_parameters()}


def train_both(rank: int, world: int, param_dtype: str) -> dict:
    """Resident and CPU-step training from the same start: both runs' masters, metrics and the dtypes."""
    out = {}
    for cpu_step in (False, True):
        torch.manual_seed(0)
        engine = _engine(cpu_step, param_dtype)
        start = _masters(engine)
        metrics = _update(engine, rank, world, slice(0, 6))  # 3 optimizer steps
        out[cpu_step] = {"start": start, "end": _masters(engine), "metrics": metrics}
        out[f"dtypes_{cpu_step}"] = sorted({str(p.dtype) for p in engine.module.parameters()})
        if cpu_step:  # the device shards hold the masters rounded to the compute dtype
            out["device_is_rounded_master"] = all(
                torch.equal(p.detach().to_local(), engine.engine.optimizer.master(p).to(p.dtype))
                for p in engine.module.parameters()
            )
    return out


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The Euclidean distance between two sets of weights."""
    return sum((a[k] - b[k]).double().square().sum().item() for k in a) ** 0.5


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_step_trains_as_the_resident_adamw_in_float32(world: int) -> None:
    for got in run_world(world, train_both, world, "auto"):
        resident, cpu = got[False], got[True]
        assert _worst(resident["start"], cpu["start"]) == 0.0
        assert _worst(resident["start"], resident["end"]) > 1e-2  # three steps at lr 1e-2 moved the weights
        assert _worst(resident["end"], cpu["end"]) < 1e-6
        assert resident["metrics"]["actor/grad_norm"] == pytest.approx(
            cpu["metrics"]["actor/grad_norm"], rel=1e-5
        )
        assert got["dtypes_True"] == ["torch.float32"] and got["device_is_rounded_master"]


def test_cpu_step_with_bf16_compute_tracks_resident_mixed_precision() -> None:
    """Masters float32, compute bf16 on both sides: the CPU step's gradients are bf16 (clipped in bf16)
    where the resident ones are float32 holding the same bf16 values scaled by the clip factor, so each
    clipped step rounds by up to 2^-9; the bf16 forward of the next step then sees some weights one bf16
    step apart. The runs stay within 2% of the distance the weights moved (measured: 0.3%), while the
    resident float32-compute run is 34 times further from the resident bf16 one than the two bf16 runs are
    from each other (asserted: over 3 times), so the tolerance tells the compute dtypes apart."""
    (got,) = run_world(1, train_both, 1, "bfloat16")
    (fp32,) = run_world(1, train_both, 1, "auto")
    resident, cpu = got[False], got[True]
    assert got["dtypes_True"] == ["torch.bfloat16"] and got["dtypes_False"] == ["torch.float32"]
    assert got["device_is_rounded_master"]

    moved = _distance(resident["start"], resident["end"])
    apart = _distance(resident["end"], cpu["end"])
    assert apart < 0.02 * moved
    assert _distance(fp32[False]["end"], resident["end"]) > 3 * apart


def save_stop_resume(rank: int, world: int, folder: str) -> dict:
    """Two updates in one run; one update, a checkpoint, a new process state, the second update."""
    from hybridflow.checkpoint.sharded import load_sharded, save_sharded
    from hybridflow.engine import full_state_dict

    torch.manual_seed(0)
    straight = _engine(True, "bfloat16")
    _update(straight, rank, world, slice(0, 4), seed=0)
    _update(straight, rank, world, slice(0, 4), seed=1)

    torch.manual_seed(0)
    first = _engine(True, "bfloat16")
    _update(first, rank, world, slice(0, 4), seed=0)
    save_sharded(folder, first.module, first.engine.optimizer)
    schedule = first.engine.scheduler.state_dict()

    torch.manual_seed(0)
    resumed = _engine(True, "bfloat16")
    load_sharded(folder, resumed.module, resumed.engine.optimizer, with_optim=True)
    resumed.engine.scheduler.load_state_dict(schedule)
    _update(resumed, rank, world, slice(0, 4), seed=1)
    resident = _engine(False, "bfloat16")  # a resident AdamW resumes from it too: its float32 weights
    load_sharded(folder, resident.module, resident.engine.optimizer, with_optim=True)
    resident_from_saved = _worst(_masters(resident), _masters(first))
    resident_steps = {int(s["step"]) for s in resident.engine.optimizer.state.values()}
    _update(resident, rank, world, slice(0, 4), seed=1)  # and the other way: a CPU step from its checkpoint
    save_sharded(folder + "-resident", resident.module, resident.engine.optimizer)
    fresh = _engine(True, "bfloat16")
    load_sharded(folder + "-resident", fresh.module, fresh.engine.optimizer, with_optim=True)
    from_resident = _worst(_masters(fresh), _masters(resident))
    weights_from_resident = max(
        (p.detach().to_local() - q.detach().to_local().to(p.dtype)).abs().max().item()
        for p, q in zip(fresh.module.parameters(), resident.module.parameters())
    )
    steps_from_resident = {int(s["step"]) for s in fresh.engine.optimizer.state.values()}
    # an HF export of the CPU-step run is its float32 masters, as the resident run's is its weights
    exported = full_state_dict(fresh.module, None, fresh.engine.optimizer)
    expected = full_state_dict(resident.module)
    export = (
        sorted({str(t.dtype) for t in exported.values()}),
        max(((exported[k] - v).abs().max().item() for k, v in expected.items()), default=None),
        len(exported) == len(expected),
    )
    a, b = straight.engine, resumed.engine
    return {
        "masters": _worst(_masters(straight), _masters(resumed)),
        "weights": max(
            (p.detach().to_local().float() - q.detach().to_local().float()).abs().max().item()
            for p, q in zip(a.module.parameters(), b.module.parameters())
        ),
        "moments": max(
            (a.optimizer.state[p][k].to_local() - b.optimizer.state[q][k].to_local()).abs().max().item()
            for p, q in zip(a.module.parameters(), b.module.parameters())
            for k in ("exp_avg", "exp_avg_sq")
        ),
        "steps": {int(s["step"]) for s in b.optimizer.state.values()},
        "resident_from_saved": resident_from_saved,
        "resident_steps": resident_steps,
        "from_resident": (from_resident, weights_from_resident, steps_from_resident),
        "export": export,
        "rank": rank,
        "lr": (a.lr, b.lr),
    }


def test_a_resumed_cpu_step_run_equals_one_that_did_not_stop(tmp_path) -> None:
    for got in run_world(2, save_stop_resume, 2, str(tmp_path / "shards")):
        assert got["masters"] == 0.0 and got["weights"] == 0.0 and got["moments"] == 0.0
        assert got["steps"] == {4} and got["lr"][0] == got["lr"][1]
        assert got["resident_from_saved"] == 0.0 and got["resident_steps"] == {2}
        # a resident run's checkpoint: its float32 weights become the masters, the device weights their cast
        assert got["from_resident"] == (0.0, 0.0, {4})
        if got["rank"] == 0:  # the full export lands on rank 0 only
            assert got["export"] == (["torch.float32"], 0.0, True)
        else:
            assert got["export"] == ([], None, True)


def test_cpu_step_refuses_a_moment_offload_and_the_reference() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["actor.fsdp.optimizer_step_on_cpu=true", "actor.fsdp.optimizer_offload=auto"])
    assert str(info.value).startswith(
        "actor.fsdp.optimizer_offload: is auto with actor.fsdp.optimizer_step_on_cpu=true: the moments already"
    )
    with pytest.raises(ConfigError, match=r"ref.fsdp.optimizer_step_on_cpu: is true: the reference has no"):
        load_config(overrides=["ref.fsdp.optimizer_step_on_cpu=true"])
    cfg = load_config(overrides=["critic.fsdp.optimizer_step_on_cpu=true", "critic.fsdp.param_offload=true"])
    assert cfg.critic.fsdp.optimizer_step_on_cpu and cfg.critic.fsdp.param_offload


def refused_in_the_engine(rank: int) -> str:
    from hybridflow.config.schema import OptimConfig
    from hybridflow.engine.parallel.parallelize import parallelize
    from hybridflow.engine.train.train_engine import TrainEngine

    fsdp = FSDPConfig(optimizer_step_on_cpu=True, optimizer_offload=True)
    model = build_tiny_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, seed=1)
    try:
        TrainEngine(parallelize(model, None, fsdp, trainable=True, compile=False), fsdp, OptimConfig())
    except UserError as e:
        return str(e)
    return "accepted"


def test_the_engine_refuses_the_cpu_step_with_moment_offload_too() -> None:
    (message,) = run_world(1, refused_in_the_engine)
    assert "optimizer_step_on_cpu=true" in message and "set optimizer_offload=false" in message


def gpu_step(rank: int) -> dict:
    """On CUDA: pinned staging, bf16 device shards and gradients, the side-stream copies; against resident."""
    engines, out = {}, {}
    for cpu_step in (False, True):  # the device bytes each engine holds once built (AdamW state included)
        before = torch.cuda.memory_allocated()
        engines[cpu_step] = _engine(cpu_step, "auto")
        out[f"bytes_{cpu_step}"] = torch.cuda.memory_allocated() - before
    for cpu_step, engine in engines.items():
        start = {k: v.cpu() for k, v in _masters(engine).items()}
        _update(engine, rank, 1, slice(0, 6))
        torch.cuda.synchronize()
        out[cpu_step] = {"start": start, "end": {k: v.cpu() for k, v in _masters(engine).items()}}
    opt = engines[True].engine.optimizer
    out["pinned"] = opt.staging.pin and opt.staging.flat.is_pinned()
    out["device_dtypes"] = {str(p.dtype) for p in engines[True].module.parameters()}
    out["master_device"] = {opt.master(p).device.type for p in engines[True].module.parameters()}
    return out


@pytest.mark.gpu
def test_cpu_step_on_cuda_streams_bf16_weights_through_pinned_memory() -> None:
    (got,) = run_world(1, gpu_step)
    assert got["pinned"] and got["device_dtypes"] == {"torch.bfloat16"} and got["master_device"] == {"cpu"}
    # bf16 shards (2 bytes a parameter) against float32 shards and two moments (12): under half even with
    # the allocator's 512-byte rounding of the tiny model's small tensors
    assert got["bytes_True"] < 0.5 * got["bytes_False"]
    assert _worst(got[False]["start"], got[True]["start"]) == 0.0
    moved = _distance(got[False]["start"], got[False]["end"])
    assert _distance(got[False]["end"], got[True]["end"]) < 0.02 * moved  # as on CPU in bf16 (see there)


def reshard_rules(rank: int) -> dict:
    """Per layer: whether FSDP2 frees it after its forward, and after the backward of an inner micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.engine.train.cpu_step import _param_groups

    out: dict = {}
    for name, cpu_step, trainable in (
        ("resident", False, True),
        ("cpu_step", True, True),
        ("frozen", False, False),
    ):
        lm = build_tiny_model("llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
        engine = ActorEngine(
            lm, actor_config(cpu_step), rollout_n=1, use_remove_padding=True, trainable=trainable
        )
        root = engine.engine.module
        groups = [
            g
            for sub in root.modules()
            if isinstance(sub, FSDPModule) and sub is not root
            for g in _param_groups(sub)
            if g is not None
        ]
        out[name] = {"after_forward": [g.post_forward_mesh_info is not None for g in groups]}
        if trainable:
            engine.engine.accumulate(0, 2)  # the first of two micro-batches
            out[name]["after_backward"] = [g.reshard_after_backward for g in groups]
    return out


def test_one_rank_frees_layers_where_gathering_them_again_is_only_a_copy() -> None:
    """At one rank a trained float32 module keeps its gathered bf16 layers (gathering again is a cast); the CPU
    step's compute-dtype shards and a frozen module free each layer after its forward and, for the CPU step,
    after each micro-batch's backward: on Qwen2-7B that is 15 GB less in the update (benchmarks/RESULTS.md)."""
    (got,) = run_world(1, reshard_rules)
    assert got["resident"] == {"after_forward": [False, False], "after_backward": [False, False]}
    assert got["cpu_step"] == {"after_forward": [True, True], "after_backward": [True, True]}
    assert got["frozen"] == {"after_forward": [True, True]}
