"""The automatic 3D layout and ``hybridflow plan``: model shapes from 0.5B to 70B on 1, 2 and 8 GPUs."""

from __future__ import annotations

import pytest

from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.engine.hybrid.memory import view_memory
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.plan import search
from hybridflow.plan.memory import gpu_memory_bytes
from hybridflow.plan.report import GB
from hybridflow.plan.search import plan_layout
from hybridflow.plan.shapes import shape_config

RUN = [
    "data.train_batch_size=64",
    "rollout.n=8",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "model.enable_gradient_checkpointing=true",
]


def _plan(shape: str, gpus: int, gb: int, extra=()):
    cfg = load_config(None, [*RUN, f"trainer.n_gpus_per_node={gpus}", *extra])
    return plan_layout(cfg, shape_config(shape), gb * 10**9, given={e.split("=")[0] for e in extra})


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "qwen2.5-7b", "llama-3-70b"])
def test_plans_on_1_2_and_8_gpus_of_80_and_141_gb(shape: str) -> None:
    for gb in (80, 141):
        peaks = []
        for gpus in (1, 2, 8):
            plan = _plan(shape, gpus, gb)
            assert plan.world == gpus and set(plan.phases) == {"generate", "log_prob", "update_actor"}
            assert f"on {gpus} GPU(s) of {gb} GB" in plan.line() and plan.views is not None
            peaks.append(min(x.peak for x in plan.considered))
            if shape == "qwen2.5-0.5b":  # small enough for the plain layout everywhere
                assert plan.fits and (plan.tp_train, plan.tp_generate, plan.param_offload) == (1, 1, False)
            if shape == "llama-3-70b" and gpus < 8:  # 141 GB of bf16 weights and grads even with the CPU step
                assert not plan.fits and "it would fit on about" in plan.line()
            if shape == "llama-3-70b" and gpus == 8:  # the CPU step leaves bf16 weights and grads on the GPUs
                assert plan.fits and plan.cpu_step
        assert peaks == sorted(peaks, reverse=True)  # more GPUs never need more memory per GPU


def test_a_7b_shape_on_80_gb_gpus() -> None:
    two = _plan("qwen2.5-7b", 2, 80)  # 61 GB of training state per GPU: only the CPU step leaves room
    assert (
        two.fits
        and two.cpu_step
        and "offload=none, checkpointing=on, micro_batch=8 does not fit" in two.line()
    )
    eight = _plan("qwen2.5-7b", 8, 80)  # the plain layout fits, but rollout tp groups decode faster
    assert (
        eight.fits and (eight.optimizer_offload, eight.cpu_step) == (False, False) and eight.tp_generate > 1
    )
    assert "the fastest that fits" in eight.line() and "fits too but is slower" in eight.line()
    # 256 x 8 samples: whole replicas on 4 GPUs leave room for 16 sequences at a time (eight waves of 512);
    # tp=4 rollout groups decode all of them at once, faster
    wide = _plan("qwen2.5-7b", 4, 80, ["data.train_batch_size=256"])
    plain = next(x for x in wide.considered if (x.tp_generate, x.optimizer_offload) == (1, False))
    assert wide.fits and wide.tp_generate > 1 and wide.max_seqs is None  # one wave: the config's value
    assert plain.fits and plain.max_seqs == 16 and plain.seconds > 2 * wide.seconds
    assert "rollout_seqs=16, fits too but is slower" in wide.line()


def test_explicit_keys_are_kept_and_pp_and_sp_wait_for_validation() -> None:
    plan = _plan("qwen2.5-0.5b", 2, 80, ["rollout.tensor_model_parallel_size=2"])
    assert (
        plan.tp_generate == 2 and "kept from the config: rollout.tensor_model_parallel_size=2" in plan.line()
    )
    model = search.meta_model(shape_config("qwen2.5-0.5b"))
    cfg = load_config(None, ["trainer.n_gpus_per_node=4"])
    candidates = search._candidates(cfg, model, 4, {})
    if not search._accepted("actor.pipeline_parallel_size"):
        assert {c.pp for c in candidates} == {1}
    if not search._accepted("actor.ulysses_sequence_parallel_size"):
        assert {c.sp for c in candidates} == {1}
    assert {c.tp_generate for c in candidates} == {1, 2}  # 14 heads: tp=4 does not split them


def test_the_estimate_is_the_reshard_plans_accounting() -> None:
    model = search.meta_model(shape_config("qwen2.5-0.5b"))
    full = view_memory(model, ParallelDims(4, 2), 2)  # with the plan's transfers
    quick = view_memory(model, ParallelDims(4, 2), 2, switch=False)
    assert (full.held_elements, full.generation_bytes) == (quick.held_elements, quick.generation_bytes)
    assert quick.received_bytes is None and full.received_bytes > 0
    assert full.full_elements == sum(p.numel() for p in model.parameters())


def test_hybridflow_plan_prints_the_plan(capsys) -> None:
    assert main(["plan", "--model-shape", "qwen2.5-7b", "--gpus", "8", "--gpu-memory-gb", "141", *RUN]) == 0
    out = capsys.readouterr().out
    assert out.startswith("auto layout: train_view=(fsdp=8), generate_view=(tp=4, dp=2)")
    assert "| update_actor |" in out and "config keys: actor.tensor_parallel_size=1" in out
    peak = max(
        float(line.split("|")[2]) for line in out.splitlines() if line.startswith(("| gen", "| log", "| upd"))
    )
    assert peak * GB == pytest.approx(_plan("qwen2.5-7b", 8, 141).peak, rel=1e-3)


@pytest.mark.parametrize("ep_generate", [1, 4])
def test_hybridflow_plan_shows_the_write_ups_moe_mapping(ep_generate: int, capsys) -> None:
    # train tp=8, ep=2 -> generate tp=4 on 16 GPUs (Mixtral-8x7B: its 8 KV heads split 8 ways), the experts
    # sliced over the rollout group or split whole over it: the same generation bytes either way
    moe = ["actor.parallel.tp=8", "actor.parallel.ep=2", "rollout.tensor_model_parallel_size=4"]
    moe.append(f"rollout.expert_parallel_size={ep_generate}")
    assert (
        main(["plan", "--model-shape", "mixtral-8x7b", "--gpus", "16", "--gpu-memory-gb", "141", *moe]) == 0
    )
    out = capsys.readouterr().out
    generate = "(tp=4, ep=4, dp=4)" if ep_generate > 1 else "(tp=4, dp=4)"
    assert out.startswith(f"auto layout: train_view=(tp=8, pp=1, dp=2, ep=2), generate_view={generate}")
    assert "generation weights 23.35 GB" in out  # 46.7B parameters in bf16 over 4 ranks
    # training keeps every MoE block whole on its tp ranks, half of the experts per ep rank: far over 141 GB
    assert "training state 364.23 GB" in out


def test_hybridflow_plan_without_a_gpu_asks_for_its_memory(capsys) -> None:
    if gpu_memory_bytes() is not None:
        pytest.skip("this machine has a GPU")
    assert main(["plan", "--model-shape", "qwen2.5-0.5b"]) == 2
    assert "pass --gpu-memory-gb" in capsys.readouterr().err


def test_hybridflow_plan_reads_the_models_config_json(tmp_path, capsys) -> None:
    from hybridflow.models import build_tiny_model_and_tokenizer

    build_tiny_model_and_tokenizer(out_dir=tmp_path / "m", hidden_size=32, num_hidden_layers=2)
    assert main(["plan", f"model.path={tmp_path / 'm'}", "--gpus", "2", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "M parameters on 2 GPU(s) of 80 GB: the simplest layout fits" in out


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2.5-VL (2 text layers, 2 vision blocks) saved to a directory, and the model."""
    from hybridflow.models.vision import build_tiny_vl_model_and_processor

    out = tmp_path_factory.mktemp("vl") / "m"
    model, _ = build_tiny_vl_model_and_processor(out_dir=out)
    return out, model


def test_a_vision_language_model_plans_its_text_model_and_its_vision_tower(tiny_vl) -> None:
    """The plan counts every parameter, the tower's too; a frozen tower (the default) holds bf16 weights and no
    gradients or moments, a trained one float32 masters, gradients and moments (16 bytes an element, not 2)."""
    from hybridflow.models.loader import load_config as load_model_config

    path, model = tiny_vl
    mc = load_model_config(path, False)
    overrides = [*RUN, "trainer.n_gpus_per_node=2"]
    frozen = plan_layout(load_config(None, overrides), mc, 80 * 10**9)
    assert frozen.fits and frozen.params == sum(p.numel() for p in model.parameters())
    assert {(x.tp_train, x.pp, x.sp, x.tp_generate) for x in frozen.considered} == {(1, 1, 1, 1)}
    trained = plan_layout(load_config(None, [*overrides, "model.freeze_vision_tower=false"]), mc, 80 * 10**9)
    tower = list(model.model.visual.parameters())
    held = sum(
        -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in tower
    )  # FSDP2's dim-0 chunk of rank 0
    a, b = frozen.considered[0], trained.considered[0]
    assert a.describe() == b.describe()
    assert b.phases["update_actor"] - a.phases["update_actor"] == 14 * held
    assert b.phases["generate"] - a.phases["generate"] == 10 * held  # masters and moments stay resident
