"""The bf16 FSDP2 actor on one GPU: packed vs padded log-probs, agreement with fp32 HF, a working update.

Run on the GPU machine with ``pytest -m gpu -s tests/engine/test_actor_gpu.py`` (``-s`` shows the measured
differences). One spawned process does all the GPU work (a process group can be created once per process,
and engines in one process share it); the tests then check its results.
"""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, Draw, rollout_batch
from support.dist_util import run_world

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

pytestmark = pytest.mark.gpu

P, R, B, VOCAB = 48, 32, 8, 512  # prompt length, response length, samples, vocabulary
TEMPERATURE = 0.8
# bf16 compute rounds every activation to 8 bits of mantissa: for this model, log-probs from bf16 weights
# differ from fp32 by ~2e-3 on average (measured on CPU). Changing the first half of a context moves the
# later log-probs by ~0.4, so these bounds are far below what a masking or packing bug would cause.
MEAN_TOL, MAX_TOL = 2e-2, 0.25


def tiny_lm(attn: str = "sdpa") -> torch.nn.Module:
    """The same weights every call: Qwen2, hidden 256, 4 layers, 4 query / 2 KV heads of dim 64, fp32."""
    return build_tiny_model(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        seed=3,
        attn_implementation=attn,
    )


PROMPT_LENGTHS = [48, 41, 18, 46, 48, 33, 1, 43]
RESPONSE_LENGTHS = [32, 17, 0, 1, 32, 9, 25, 30]


def make_batch(seed: int = 0, shift: int = 0) -> Batch:
    """Left-padded prompts of varied length + right-padded responses (one empty, one filling the context).

    ``shift`` rolls the lengths over the rows: the same tokens per batch, new sequence bounds.
    """
    prompts = torch.tensor(PROMPT_LENGTHS).roll(shift).tolist()
    responses = torch.tensor(RESPONSE_LENGTHS).roll(2 * shift).tolist()
    return rollout_batch(
        prompts, responses, R, seed, tokens=(1, VOCAB), advantages=NORMAL, ref_log_prob=Draw(-3.0, 0.0)
    )


@torch.no_grad()
def fp32_reference(lm: torch.nn.Module, batch: Batch, join_sequences: bool = False) -> torch.Tensor:
    """Response log-probs (B, R) from a direct fp32 HF forward of each unpadded sequence (CPU).

    With ``join_sequences`` every sequence is instead scored after all earlier ones, as one long context:
    what packing would compute if attention leaked across sequence boundaries.
    """
    out = torch.zeros(B, R)
    context = torch.zeros(1, 0, dtype=torch.long)
    for b in range(B):
        seq = batch["input_ids"][b][batch["attention_mask"][b].bool()][None]  # (1, L)
        n_resp = int(batch["response_mask"][b].sum())
        full = torch.cat([context, seq], dim=1) if join_sequences else seq
        logp = torch.log_softmax(lm(full).logits[0].float() / TEMPERATURE, -1)  # (L', V)
        start = full.shape[1] - n_resp
        for j in range(n_resp):
            out[b, j] = logp[start - 1 + j, full[0, start + j]]
        context = full
    return out


def actor_config() -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = 4
    cfg.ppo_micro_batch_size_per_gpu = 2
    cfg.ppo_epochs = 2
    cfg.use_kl_loss = True
    cfg.entropy_coeff = 0.01
    cfg.optim.lr = 1e-3
    return cfg


def gpu_work(rank: int) -> dict:
    """Everything that needs CUDA, in one spawned process; returns CPU tensors and floats."""
    from torch._dynamo.utils import counters

    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.actor import ActorEngine

    out: dict = {}
    # Default on GPU: compiled decoder layers, and packed attention through the flash varlen op.
    for name, attn, packed, micro, fused, compiled in [
        ("padded", "sdpa", False, 3, True, None),
        ("packed", "sdpa", True, 3, True, None),
        ("packed_eager", "sdpa", True, 3, True, False),
        ("packed_flex", "flex_attention", True, B, True, False),  # one micro-batch: one compiled shape
        ("packed_ckpt_head", "sdpa", True, 3, False, False),  # the checkpointed LM head, not the fused one
    ]:
        cfg = actor_config()
        cfg.use_torch_compile = compiled
        engine = ActorEngine(tiny_lm(attn), cfg, use_remove_padding=packed, trainable=False, fused_head=fused)
        out[f"{name}_dtype"] = engine.engine.compute_dtype
        out[f"{name}_compiled"] = engine.engine.compiled
        out[name] = engine.compute_log_prob(make_batch(), TEMPERATURE, micro_batch_size=micro)["log_probs"]
        if name == "packed":  # new bounds and new totals: at most the one recompile to dynamic sizes
            engine.compute_log_prob(make_batch(shift=1), TEMPERATURE, micro_batch_size=micro)
            settled = counters["stats"]["unique_graphs"]
            for shift in (2, 3):
                engine.compute_log_prob(make_batch(shift=shift), TEMPERATURE, micro_batch_size=micro)
            out["recompiles_after_settling"] = counters["stats"]["unique_graphs"] - settled
        del engine

    engine = ActorEngine(tiny_lm(), actor_config(), use_remove_padding=True)
    batch = make_batch()
    batch["old_log_probs"] = engine.compute_log_prob(batch, micro_batch_size=4)["log_probs"]
    # Cloned: on a CPU-resident model the "full" state dict can share storage with the parameters.
    before = {k: v.clone() for k, v in full_state_dict(engine.module).items()}
    out["metrics"] = engine.update_policy(batch)
    after = full_state_dict(engine.module)
    out["weight_change"] = {k: float((after[k] - before[k]).abs().max()) for k in before}
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    (res,) = run_world(1, gpu_work, timeout=600.0)
    print(f"\nGPU: {res['device']}")
    return res


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    lm = tiny_lm().eval()
    batch = make_batch()
    return {"logp": fp32_reference(lm, batch), "leaky": fp32_reference(lm, batch, join_sequences=True)}


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean, max) absolute difference over the valid response tokens."""
    mask = make_batch()["response_mask"].bool()  # (B, R)
    d = (a - b).abs()[mask]
    return float(d.mean()), float(d.max())


def test_the_engine_computes_in_bf16(results: dict) -> None:
    assert results["padded_dtype"] == results["packed_dtype"] == torch.bfloat16


def test_layers_compile_by_default_and_new_bounds_do_not_recompile(results: dict) -> None:
    assert results["packed_compiled"] and results["padded_compiled"] and not results["packed_eager_compiled"]
    assert results["recompiles_after_settling"] == 0


def test_compiled_flash_and_eager_packed_log_probs_agree(results: dict) -> None:
    mean, worst = diff_stats(results["packed"], results["packed_eager"])
    print(f"\nbf16 compiled vs eager (packed, flash varlen): mean abs diff {mean:.2e}, max {worst:.2e}")
    assert mean < MEAN_TOL and worst < MAX_TOL


def test_fused_and_checkpointed_heads_agree_in_bf16(results: dict) -> None:
    mean, worst = diff_stats(results["packed_eager"], results["packed_ckpt_head"])
    print(f"\nbf16 fused vs checkpointed LM head: mean abs diff {mean:.2e}, max {worst:.2e}")
    assert worst < 1e-4  # the same bf16 logits; only the order of the float32 softmax math differs


def test_packed_and_padded_log_probs_agree_in_bf16(results: dict) -> None:
    mean, worst = diff_stats(results["packed"], results["padded"])
    print(f"\nbf16 packed vs padded (sdpa): mean abs diff {mean:.2e}, max {worst:.2e}")
    assert mean < MEAN_TOL and worst < MAX_TOL
    empty = ~make_batch()["response_mask"].bool()
    assert (results["packed"][empty] == 0).all() and (results["padded"][empty] == 0).all()


@pytest.mark.parametrize("layout", ["padded", "packed", "packed_eager", "packed_flex", "packed_ckpt_head"])
def test_bf16_log_probs_track_an_fp32_hf_forward(results: dict, reference: dict, layout: str) -> None:
    mean, worst = diff_stats(results[layout], reference["logp"])
    print(f"\nbf16 {layout} vs fp32 HF forward: mean abs diff {mean:.2e}, max {worst:.2e}")
    assert mean < MEAN_TOL and worst < MAX_TOL
    # The bound can fail: attention leaking across packed sequences would move log-probs this much.
    leak_mean, _ = diff_stats(reference["leaky"], reference["logp"])
    assert leak_mean > 5 * MEAN_TOL


def test_update_policy_runs_in_bf16_and_changes_weights(results: dict) -> None:
    metrics = results["metrics"]
    print(f"\nupdate metrics: { {k: round(v, 5) for k, v in metrics.items()} }")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["actor/grad_norm"] > 0
    # Two epochs x two mini-batches of Adam at lr 1e-3 move every weight matrix by ~1e-3 or more. (Biases
    # are left out: the k_proj bias has a zero gradient in exact arithmetic, softmax being shift-invariant.)
    matrices = {k: v for k, v in results["weight_change"].items() if k.endswith("weight")}
    assert len(matrices) >= 4 * 9  # per layer: 7 projections and 2 norms
    unchanged = [k for k, v in matrices.items() if not v > 1e-4]
    assert not unchanged, unchanged
