"""The FSDP2 actor engine: log-probs against HF, and updates that do not depend on how the data is split."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, Draw, rollout_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

P, R, B = 6, 5, 8  # prompt length, response length, samples
PROMPT_LENGTHS = [6, 4, 5, 3, 6, 2, 5, 6]
RESPONSE_LENGTHS = [5, 3, 0, 2, 5, 1, 4, 5]  # row 2: fully masked response; row 0: fills the context


def make_batch(seed: int = 0) -> Batch:
    """Left-padded prompts + right-padded responses, with a fully masked response and a full-length row."""
    return rollout_batch(
        PROMPT_LENGTHS, RESPONSE_LENGTHS, R, seed, advantages=NORMAL, ref_log_prob=Draw(-3.0, 0.0)
    )


def actor_config(**overrides) -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = 4
    cfg.ppo_micro_batch_size_per_gpu = 3
    cfg.ppo_epochs = 2
    cfg.use_kl_loss = True
    cfg.entropy_coeff = 0.01
    cfg.optim.lr = 1e-2
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def train(rank: int, world: int, variants: list[tuple[bool, dict, dict]]) -> list[dict]:
    """Per variant (remove_padding, config overrides, engine kwargs): old log-probs, two PPO epochs over two
    mini-batches, then the full weights (rank 0 returns them). One process group serves every variant."""
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.actor import ActorEngine

    results = []
    for remove_padding, overrides, kwargs in variants:
        torch.manual_seed(0)
        lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
        cfg = actor_config(**overrides)
        engine = ActorEngine(lm, cfg, rollout_n=1, use_remove_padding=remove_padding, **kwargs)
        full = make_batch()
        # Each rank gets its half of every mini-batch, as the driver's dispatch hands them out.
        rows = [i for m in range(0, B, 4) for i in range(m + rank * 4 // world, m + (rank + 1) * 4 // world)]
        batch = full[rows]
        batch["old_log_probs"] = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"] - 0.05
        metrics = engine.update_policy(batch)
        state = full_state_dict(engine.module)
        results.append({"metrics": metrics, "state": state if rank == 0 else None})
    return results


@torch.no_grad()
def reference_log_probs(lm: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """Direct HF forward per sequence, no padding at all."""
    out = torch.zeros(B, R)
    for b in range(B):
        keep = batch["attention_mask"][b].bool()
        seq = batch["input_ids"][b][keep][None]
        n_resp = int(batch["attention_mask"][b, -R:].sum())
        logp = torch.log_softmax(lm(seq).logits[0].float() / temperature, -1)
        start = seq.shape[1] - n_resp
        for j in range(n_resp):
            out[b, j] = logp[start - 1 + j, seq[0, start + j]]
    return out


def score(rank: int, layouts: list[tuple[bool, bool, bool]]) -> list[float]:
    """Worst |engine - HF| log-prob for each (remove_padding, dynamic micro-batches, fused head)."""
    from hybridflow.engine.roles.actor import ActorEngine

    errors = []
    for remove_padding, dynamic, fused in layouts:
        lm = build_tiny_model("llama", vocab_size=64, hidden_size=32, seed=2)
        ref = reference_log_probs(lm, make_batch(), temperature=0.7)
        engine = ActorEngine(
            lm, actor_config(), use_remove_padding=remove_padding, trainable=False, fused_head=fused
        )
        got = engine.compute_log_prob(
            make_batch(), 0.7, micro_batch_size=3, use_dynamic_bsz=dynamic, max_token_len=24
        )
        errors.append(float((got["log_probs"] - ref).abs().max()))
    return errors


def test_log_probs_equal_a_direct_hf_forward() -> None:
    layouts = [(False, False, True), (True, False, True), (True, True, True), (True, False, False)]
    (errors,) = run_world(1, score, layouts)
    for layout, err in zip(layouts, errors):
        assert err < 1e-5, layout


def _assert_same(a: dict, b: dict, weight_atol: float = 1e-5) -> None:
    assert a["metrics"].keys() == b["metrics"].keys()
    for key in a["metrics"]:
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, tensor in a["state"].items():
        torch.testing.assert_close(tensor, b["state"][name], rtol=1e-4, atol=weight_atol, msg=name)


# The engine's FSDP2 gradient-accumulation levers, off (reduce-scatter and reshard every micro-batch) and
# on; with None (the default) they are on at world size 1 and off at 2.
EAGER_SYNC = {"defer_grad_sync": False, "keep_params_gathered": False}
DEFERRED = {"defer_grad_sync": True, "keep_params_gathered": True}


def test_two_ranks_match_one_rank_and_the_layouts_agree() -> None:
    """Same loss, grad norm and weights for: 1 vs 2 ranks, padded vs packed, fixed vs dynamic micro-batches,
    the fused vs the checkpointed LM head, and FSDP2 gradient sync deferred or not over the micro-batches."""
    one, one_eager, one_unfused, packed, dynamic, single_rows = run_world(
        1,
        train,
        1,
        [
            (False, {}, {}),
            (False, {}, EAGER_SYNC),
            (False, {}, {"fused_head": False}),
            (True, {}, {}),
            (True, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 20}, {}),
            # One row per micro-batch: row 2 has no response token, an empty micro-batch for the head.
            (True, {"ppo_micro_batch_size_per_gpu": 1}, {}),
        ],
    )[0]
    # At 2 ranks a mini-batch is 2 rows per rank: one row per micro-batch gives the deferred sync 2 of them.
    two, two_deferred = run_world(
        2, train, 2, [(False, {}, {}), (False, {"ppo_micro_batch_size_per_gpu": 1}, DEFERRED)]
    )[0]
    _assert_same(one, two)
    _assert_same(one_eager, two_deferred)
    _assert_same(one, one_eager)
    assert one["metrics"]["actor/ppo_kl"] != 0  # off-policy: the engine really used old_log_probs
    # Packing, or the other head, changes the float32 summation order inside attention and matmuls (grads
    # agree to ~1e-7 relative); Adam's normalised steps (lr 1e-2, 4 steps, updates ~4e-2) carry that to
    # ~5e-5 in the weights, where a gradient is near zero.
    _assert_same(one, one_unfused, weight_atol=1e-4)
    _assert_same(one, packed, weight_atol=1e-4)
    _assert_same(packed, dynamic)
    _assert_same(packed, single_rows)
    assert one["metrics"]["actor/grad_norm"] > 0
    initial = build_tiny_model(
        "qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1
    ).state_dict()
    assert any(not torch.allclose(initial[k.removeprefix("lm.")], v) for k, v in one["state"].items())


def train_variants(rank: int) -> dict:
    """Gradient checkpointing, and a NaN advantage that must skip the step without touching the weights."""
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.actor import ActorEngine

    results = {}
    for name, ckpt, poison in (("plain", False, False), ("ckpt", True, False), ("nan", False, True)):
        lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
        cfg = actor_config(ppo_epochs=1, ppo_mini_batch_size=B)  # one optimizer step
        engine = ActorEngine(lm, cfg, gradient_checkpointing=ckpt, use_remove_padding=True)
        batch = make_batch()
        batch["old_log_probs"] = engine.compute_log_prob(batch)["log_probs"]
        if poison:
            batch["advantages"][1, 0] = float("nan")
        results[name] = {"metrics": engine.update_policy(batch), "state": full_state_dict(engine.module)}
    return results


def test_gradient_checkpointing_matches_and_nonfinite_grads_skip_the_step() -> None:
    res = run_world(1, train_variants)[0]
    _assert_same(res["plain"], res["ckpt"])
    initial = build_tiny_model(
        "qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1
    ).state_dict()
    nan = res["nan"]
    assert nan["metrics"]["actor/skipped_steps"] == 1
    assert res["plain"]["metrics"]["actor/skipped_steps"] == 0
    for name, tensor in nan["state"].items():
        assert torch.equal(tensor, initial[name.removeprefix("lm.")]), name


def test_bad_shapes_and_dtypes_get_clear_errors() -> None:
    from hybridflow.engine.ops.packing import build_scoring_inputs

    batch = make_batch()
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    with pytest.raises(ValueError, match=r"must both be \(batch, seq_len\)"):
        build_scoring_inputs(ids[0], mask[0], pos[0], R, True)
    with pytest.raises(TypeError, match="integer tensor"):
        build_scoring_inputs(ids.float(), mask, pos, R, True)
    with pytest.raises(ValueError, match="response length 11 must be positive and shorter"):
        build_scoring_inputs(ids, mask, pos, P + R, True)


def frozen_in_bf16(rank: int) -> dict:
    """A frozen engine computing in bf16, its weights stored as 'auto' (bf16) and as float32."""
    from hybridflow.config.schema import FSDPConfig
    from hybridflow.engine.roles.actor import ActorEngine

    out = {}
    for master in ("auto", "float32"):
        lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, seed=3)
        fsdp = FSDPConfig(param_dtype="bfloat16", master_dtype=master)
        engine = ActorEngine(lm, actor_config(), use_remove_padding=True, trainable=False, fsdp=fsdp)
        dtypes = {p.dtype for p in engine.module.parameters()}
        logps = engine.compute_log_prob(make_batch(), 1.0, micro_batch_size=3)["log_probs"]
        out[master] = (dtypes, logps)
    trained = ActorEngine(build_tiny_model("qwen2", vocab_size=64, hidden_size=32), actor_config(), fsdp=fsdp)
    out["trained"] = {p.dtype for p in trained.module.parameters()}
    return out


def test_a_frozen_engine_keeps_its_weights_in_the_compute_dtype_with_equal_log_probs() -> None:
    """master_dtype=auto stores the reference in bf16 when it computes in bf16 (half the bytes); FSDP2's
    per-forward cast of float32 weights rounds the same way, so the log-probs are bit-identical."""
    out = run_world(1, frozen_in_bf16)[0]
    assert out["auto"][0] == {torch.bfloat16}
    assert out["float32"][0] == {torch.float32}
    assert out["trained"] == {torch.float32}  # a trained role keeps float32 masters under auto
    assert torch.equal(out["auto"][1], out["float32"][1])


def update_without_old_log_probs(rank: int) -> dict:
    """On-policy: the update keeps its own pre-step log-probs. Two mini-batches: a clear error instead."""
    from hybridflow.engine.roles.actor import ActorEngine

    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    engine = ActorEngine(lm, actor_config(ppo_epochs=1, ppo_mini_batch_size=B), use_remove_padding=True)
    batch = make_batch()
    before = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"]
    engine.update_policy(batch)
    kept = engine.last_log_probs
    after = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"]
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    two_minis = ActorEngine(lm, actor_config(ppo_epochs=1, ppo_mini_batch_size=4), use_remove_padding=True)
    try:
        two_minis.update_policy(make_batch())
        error = ""
    except ValueError as e:
        error = str(e)
    mask = batch["response_mask"].bool()
    return {
        "kept_vs_before": float((kept - before)[mask].abs().max()),
        "after_vs_before": float((after - before)[mask].abs().max()),
        "error": error,
    }


def test_an_on_policy_update_keeps_its_own_pre_step_log_probs() -> None:
    res = run_world(1, update_without_old_log_probs)[0]
    assert res["kept_vs_before"] < 1e-5  # the update's forward ran on the weights before its step
    assert res["after_vs_before"] > 1e-3  # and the step then moved them
    assert "no old_log_probs" in res["error"] and "2 mini-batches" in res["error"]


def gathered_after_passes(rank: int) -> dict:
    """Whether any parameter is left gathered (a plain tensor, not the sharded DTensor) after each phase."""
    from torch.distributed.tensor import DTensor

    from hybridflow.engine.roles.actor import ActorEngine

    def gathered(engine: ActorEngine) -> int:
        return sum(not isinstance(p, DTensor) for p in engine.module.parameters())

    frozen = ActorEngine(
        build_tiny_model("qwen2", vocab_size=64, hidden_size=32), actor_config(), trainable=False
    )
    trained = ActorEngine(build_tiny_model("qwen2", vocab_size=64, hidden_size=32), actor_config())
    batch = make_batch()
    out = {"before": gathered(frozen)}
    frozen.compute_log_prob(batch, 1.0, micro_batch_size=3)
    out["reference pass"] = gathered(frozen)
    batch["old_log_probs"] = trained.compute_log_prob(batch, 1.0, micro_batch_size=3)["log_probs"]
    out["old-log-prob pass"] = gathered(trained)
    trained.update_policy(batch)
    out["update"] = gathered(trained)
    return out


def test_no_phase_leaves_the_gathered_parameters_behind() -> None:
    # At world size 1 the engine keeps parameters gathered after forward (no reshard_after_forward) for the
    # backward; a forward-only pass has none, so without an explicit reshard a frozen reference would hold
    # its weights twice for the rest of the run (3.1 GB at 1.5B in bf16).
    assert run_world(1, gathered_after_passes)[0] == {
        "before": 0,
        "reference pass": 0,
        "old-log-prob pass": 0,
        "update": 0,
    }


def test_shuffle_reorders_the_mini_batches_of_each_epoch_reproducibly() -> None:
    shuffle = (True, {"shuffle": True}, {})
    (plain, shuffled, again) = run_world(1, train, 1, [(True, {}, {}), shuffle, shuffle])[0]
    differs = [not torch.equal(shuffled["state"][k], plain["state"][k]) for k in plain["state"]]
    assert any(differs)  # other samples met in each mini-batch: other steps
    assert all(torch.equal(shuffled["state"][k], again["state"][k]) for k in plain["state"])  # seeded
    assert shuffled["metrics"]["actor/pg_loss"] == again["metrics"]["actor/pg_loss"]
