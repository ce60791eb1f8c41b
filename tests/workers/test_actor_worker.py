"""The actor worker's rollout on its own FSDP2-wrapped weights: HF generate beside the built-in engine;
on the GPU, generation while the parameters are offloaded and the room ``optimizer_offload=auto`` makes.

With ``actor.fsdp.param_offload`` the parameters are on the host whenever no phase runs, including when the
rollout engine is built and when it generates. The built-in engine must still run on the trainer's GPU,
reading the weights into its cast buffers there; HF ``generate`` runs a replica refreshed from the shards
(it cannot run the FSDP2-wrapped module itself).
"""

from __future__ import annotations

import os

import pytest
import torch
from support.batches import prompt_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.protocol import Batch


def prompts() -> Batch:
    """Four left-padded prompts of 3-6 tokens."""
    return prompt_batch([6, 5, 3, 4], seed=0)


def generate_with(rank: int, overrides: list[str], cpu: bool = False) -> dict:
    """Greedy responses of a fresh tiny actor built with ``overrides``, and where its pieces live."""
    if cpu:  # float32 on the CPU even on a GPU host (this process has not touched CUDA yet)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridflow.config import load_config
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    cfg = load_config(None, ["data.max_response_length=8", "rollout.ignore_eos=true", *overrides])
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=5)
    worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
    params = worker.sampling_params(1, 0.0, 1.0, -1, False, [], None)
    out = worker.generate(prompts(), params)
    return {
        "responses": out["responses"],
        "rollout_device": str(worker.hybrid.rollout.device)
        if hasattr(worker.hybrid.rollout, "device")
        else None,
        "param_device_after": str(next(worker.hf_model.parameters()).device),
    }


def test_hf_generate_in_the_worker_gives_the_built_in_engines_tokens() -> None:
    (native,) = run_world(1, generate_with, ["rollout.engine=native"], True)
    (hf,) = run_world(1, generate_with, ["rollout.engine=hf"], True)
    assert torch.equal(hf["responses"], native["responses"])


def test_optimizer_offload_auto_generates_as_before_on_cpu() -> None:
    # Nothing is sized from memory on CPU: auto never moves anything there, and the tokens are the same.
    (auto,) = run_world(1, generate_with, ["actor.fsdp.optimizer_offload=auto"], True)
    (plain,) = run_world(1, generate_with, [], True)
    assert torch.equal(auto["responses"], plain["responses"])


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_an_offloaded_actor_generates_on_the_gpu_like_one_on_the_gpu(engine: str) -> None:
    common = [f"rollout.engine={engine}", "actor.use_torch_compile=false"]
    (on_gpu,) = run_world(1, generate_with, common)
    (offloaded,) = run_world(1, generate_with, [*common, "actor.fsdp.param_offload=true"])
    assert offloaded["param_device_after"] == "cpu"  # generation left the parameters where they were
    if engine == "native":
        assert offloaded["rollout_device"] == on_gpu["rollout_device"] == "cuda:0"
    assert torch.equal(offloaded["responses"], on_gpu["responses"])


def cast_buffer_bytes(rank: int) -> dict:
    """Bytes of the rollout's cast weights at build time and after a call, and the call's tokens."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridflow.config import load_config
    from hybridflow.engine.rollout.engine import PagedEngine
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    def held(engine: PagedEngine) -> int:
        return sum(t.untyped_storage().nbytes() for t in engine.runner.weight_tensors())

    # bfloat16 generation from float32 masters: the engine works from cast copies of the weights.
    overrides = ["data.max_response_length=8", "rollout.dtype=bfloat16", "rollout.free_cache_engine=false"]
    overrides.append("rollout.allow_dtype_mismatch=true")  # bf16 generation, float32 training on the CPU
    cfg = load_config(None, overrides)
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=5)
    plain = PagedEngine(
        build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=5),
        dtype=torch.bfloat16,
    )
    worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
    at_build = held(worker.hybrid.rollout)
    params = worker.sampling_params(1, 0.0, 1.0, -1, False, [], None)
    out = worker.generate(prompts(), params)
    rows = [row[m.bool()].tolist() for row, m in zip(prompts()["input_ids"], prompts()["attention_mask"])]
    want = [g[0].token_ids for g in plain.generate(rows, params)]
    return {
        "at_build": at_build,
        "after": held(worker.hybrid.rollout),
        "got": out["responses"].tolist(),
        "want": want,
    }


def test_the_rollout_holds_no_weight_copy_before_it_generates() -> None:
    (r,) = run_world(1, cast_buffer_bytes)
    assert r["at_build"] == 0  # nothing allocated for SFT/DPO/KTO jobs, or before the first rollout
    assert r["after"] > 0  # filled by the call (and kept: free_cache_engine=false)
    assert [row[: len(w)] for row, w in zip(r["got"], r["want"])] == r[
        "want"
    ]  # refilled with the real weights


def utilization_short_by(rollout, rows: list[list[int]], params, short: float) -> float:
    """The ``rollout.gpu_memory_utilization`` at which the KV pool lacks ``short`` bytes to hold every
    sequence of this call at once, at the memory in use now."""
    from hybridflow.utils.device import gpu_memory_limit

    rollout.cfg.gpu_memory_utilization = 0.0
    everything = rollout.memory_shortfall(rows, params)  # what the pool needs, and all the memory in use
    return (everything - short) / gpu_memory_limit(rollout.device)


def pool_bytes(rollout, rows: list[list[int]], params) -> int:
    """The bytes the KV pool needs to hold every sequence of this call at once (beyond the memory in use)."""
    rollout.cfg.gpu_memory_utilization = 0.0
    everything = rollout.memory_shortfall(rows, params)
    return everything - torch.cuda.memory_allocated(rollout.device) - rollout.runner.pending_bytes()


def at_once(out: Batch) -> int:
    """The most sequences the rollout decoded at once."""
    return int(out.meta["rollout_stats"]["concurrent_seqs_peak"])


def rollout_short_of_room(rank: int) -> dict:
    """Rollouts of 32 sequences with the KV pool's budget set to half of what holding them all at once needs,
    without and with ``actor.fsdp.optimizer_offload=auto``; where the AdamW moments are after each."""
    from hybridflow.config import load_config
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    overrides = ["data.max_response_length=32", "rollout.ignore_eos=true", "rollout.enforce_eager=true"]
    cfg = load_config(
        None, [*overrides, "actor.use_torch_compile=false", "actor.fsdp.optimizer_offload=auto"]
    )
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=256, num_hidden_layers=4, seed=5)
    worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
    engine, rollout = worker.engine.engine, worker.hybrid.rollout
    params = worker.sampling_params(8, 0.0, 1.0, -1, False, [], None)  # 4 prompts x 8 = 32 sequences
    rows = [row[m.bool()].tolist() for row, m in zip(prompts()["input_ids"], prompts()["attention_mask"])]

    def moments_device() -> str:
        return str(next(iter(engine.optimizer.state.values()))["exp_avg"].device)

    def run(auto: bool, short_of_room: bool) -> dict:
        worker.hybrid.room_donors = [engine] if auto else []  # as built with optimizer_offload=auto / false
        utilization = 0.5
        if short_of_room:  # a budget for half of the pool, set from the memory in use right now
            utilization = utilization_short_by(rollout, rows, params, pool_bytes(rollout, rows, params) / 2)
        rollout.cfg.gpu_memory_utilization = utilization
        if short_of_room:
            assert rollout.memory_shortfall(rows, params) > 0
        out = worker.generate(prompts(), params)
        return {"at_once": at_once(out), "moments": moments_device()}

    roomy = run(auto=True, short_of_room=False)
    short = run(auto=False, short_of_room=True)
    made_room = run(auto=True, short_of_room=True)
    made_room["pinned"] = next(iter(engine.optimizer.state.values()))["exp_avg"].to_local().is_pinned()
    engine.onload()  # the next phase brings the moments back
    return {"roomy": roomy, "short": short, "made_room": made_room, "after_onload": moments_device()}


@pytest.mark.gpu
def test_optimizer_offload_auto_makes_room_for_a_rollout_that_would_not_fit_at_once() -> None:
    (got,) = run_world(1, rollout_short_of_room)
    assert got["roomy"] == {"at_once": 32, "moments": "cuda:0"}  # enough room: nothing moves
    assert got["short"]["at_once"] < 32 and got["short"]["moments"] == "cuda:0"
    assert got["made_room"] == {"at_once": 32, "moments": "cpu", "pinned": True}
    assert got["after_onload"] == "cuda:0"


def room_from_actor_and_critic(rank: int) -> dict:
    """PPO roles with ``optimizer_offload=auto`` on actor and critic: where the moments are after rollouts
    short of less than the actor's moments, and of more."""
    from hybridflow.config import load_config
    from hybridflow.engine.parallel.fsdp import optimizer_state_bytes
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.build import build_roles

    auto = ["actor.fsdp.optimizer_offload=auto", "critic.fsdp.optimizer_offload=auto"]
    overrides = ["data.max_response_length=32", "rollout.ignore_eos=true", "rollout.enforce_eager=true"]
    off = ["actor.use_torch_compile=false", "critic.use_torch_compile=false"]
    cfg = load_config(None, [*overrides, *off, *auto, "algorithm.adv_estimator=gae"])
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=256, num_hidden_layers=4, seed=5)
    roles = build_roles(cfg, model, total_steps=1, pad_id=0)
    worker, actor, critic = roles["actor"], roles["actor"].engine.engine, roles["critic"].engine.engine
    rollout = worker.hybrid.rollout
    params = worker.sampling_params(8, 0.0, 1.0, -1, False, [], None)  # 4 prompts x 8 = 32 sequences
    rows = [row[m.bool()].tolist() for row, m in zip(prompts()["input_ids"], prompts()["attention_mask"])]
    moments = {
        "actor": optimizer_state_bytes(actor.optimizer),
        "critic": optimizer_state_bytes(critic.optimizer),
    }

    def where(engine) -> str:
        return str(next(iter(engine.optimizer.state.values()))["exp_avg"].device.type)

    def short_by(nbytes: int) -> dict:
        """One rollout whose KV pool lacks ``nbytes`` to hold every sequence at once; then both roles' next
        phase."""
        rollout.cfg.gpu_memory_utilization = utilization_short_by(rollout, rows, params, nbytes)
        out = worker.generate(prompts(), params)
        got = {"at_once": at_once(out), "actor": where(actor), "critic": where(critic)}
        actor.onload(), critic.onload()
        return got

    return {
        "donors": [d is actor for d in worker.room_donors] + [d is critic for d in worker.room_donors],
        "actor_enough": short_by(moments["actor"] // 2),
        "both_needed": short_by(moments["actor"] + moments["critic"] // 2),
        "back": (where(actor), where(critic)),
    }


@pytest.mark.gpu
def test_optimizer_offload_auto_takes_the_critics_moments_when_the_actors_are_not_enough() -> None:
    (got,) = run_world(1, room_from_actor_and_critic)
    assert got["donors"] == [True, False, False, True]  # the actor's engine first, then the critic's
    assert got["actor_enough"] == {"at_once": 32, "actor": "cpu", "critic": "cuda"}
    assert got["both_needed"] == {"at_once": 32, "actor": "cpu", "critic": "cpu"}
    assert got["back"] == ("cuda", "cuda")
