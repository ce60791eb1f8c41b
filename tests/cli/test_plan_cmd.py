"""``hybridflow plan``: its options checked, its figures readable at any size, the host memory checked or said
to be unchecked, the candidates table short unless ``--all``, keys it plans never refused before it plans them,
and vision-language models planned (the text model and the vision tower)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.plan import memory
from hybridflow.plan.search import plan_layout
from hybridflow.plan.shapes import shape_config

pytestmark = pytest.mark.usefixtures("restore_cli_logging")

# 16 prompts x 8 samples of 256 + 512 tokens (the planner's issue workload)
WORK = [
    "data.train_batch_size=16",
    "rollout.n=8",
    "data.max_prompt_length=256",
    "data.max_response_length=512",
]


def _rows(out: str) -> list[str]:
    """The candidates table's rows (one per layout)."""
    return [line for line in out.splitlines() if line.startswith("| train_view=")]


@pytest.mark.parametrize("value", ["0", "-3", "0.001", "0.5", "nan", "inf", "eighty"])
def test_a_gpu_memory_that_no_gpu_has_is_refused_in_one_line(value: str, capsys) -> None:
    assert main(["plan", "--model-shape", "qwen2.5-0.5b", "--gpus", "1", "--gpu-memory-gb", value]) == 2
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert (
        line.startswith("error: --gpu-memory-gb: ") and "at least 1" in line and "--gpu-memory-gb 80" in line
    )


def test_a_host_memory_that_no_node_has_is_refused_in_one_line(capsys) -> None:
    argv = ["plan", "--model-shape", "qwen2.5-0.5b", "--gpus", "1", "--gpu-memory-gb", "80"]
    assert main([*argv, "--host-memory-gb", "0.01"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith("error: --host-memory-gb: ") and "memory of one node" in line and "at least 1" in line
    )


def test_small_figures_never_read_as_zero(tmp_path: Path, capsys) -> None:
    """A tiny model on a 1 GB GPU: every figure of the phases, the usable memory and the table is above 0."""
    from hybridflow.models import build_tiny_model_and_tokenizer

    build_tiny_model_and_tokenizer(out_dir=tmp_path / "m", hidden_size=32, num_hidden_layers=2)
    argv = ["plan", f"model.path={tmp_path / 'm'}", "--gpus", "1", "--gpu-memory-gb", "1", *WORK]
    assert main([*argv, "actor.fsdp.param_offload=true", "actor.fsdp.optimizer_offload=true"]) == 0
    out = capsys.readouterr().out
    phases = [line for line in out.splitlines() if line.startswith(("| generate", "| log_prob", "| update"))]
    assert len(phases) == 3 and all(float(line.split("|")[2]) > 0 for line in phases)
    state = re.search(r"training state ([0-9.]+) GB.*generation weights ([0-9.]+) GB", out)
    assert state and float(state[1]) > 0 and float(state[2]) > 0
    assert float(re.search(r"host memory per node \(offload, CPU step\): ([0-9.]+) GB", out)[1]) > 0
    for row in _rows(out):
        cells = row.split("|")
        assert float(cells[3]) > 0 and float(cells[4]) > 0 and float(cells[5]) > 0  # GPU GB, host GB, seconds


def test_a_layout_short_by_a_hair_never_reads_as_needing_what_it_has() -> None:
    """The simplest layout a few kB over the usable memory: its two figures differ, the first the larger."""
    cfg = load_config(None, [*WORK, "trainer.n_gpus_per_node=1"])
    roomy = plan_layout(cfg, shape_config("qwen2.5-0.5b"), 80 * 10**9)
    simplest = roomy.considered[0]
    usable = simplest.peak - 4096  # 4 kB short
    plan = plan_layout(cfg, shape_config("qwen2.5-0.5b"), -(-usable * 10 // 9) - 1)
    assert plan.considered[0].usable < plan.considered[0].peak
    verdict = plan.considered[0].verdict(plan)
    needs, has = (float(x) for x in re.search(r"needs ([0-9.]+) of ([0-9.]+) GB", verdict).groups())
    assert needs > has


def test_the_table_shows_the_choice_and_the_best_three_of_each_verdict(capsys) -> None:
    """7B on 8 GPUs of 24 GB: 1,500 candidates, slower ones and ones whose generate or update does not fit."""
    argv = ["plan", "--model-shape", "qwen2.5-7b", "--gpus", "8", "--gpu-memory-gb", "24", *WORK]
    assert main(argv) == 0
    short = capsys.readouterr().out
    rows = _rows(short)
    assert main([*argv, "--all"]) == 0
    out = capsys.readouterr().out
    every = _rows(out)
    cfg = load_config(None, [*WORK, "trainer.n_gpus_per_node=8"])
    plan = plan_layout(cfg, shape_config("qwen2.5-7b"), 24 * 10**9)
    assert len(every) == len(plan.considered) > 40 and "more candidates" not in out
    total = len(every)
    assert f"({total - len(rows)} more candidates not shown; --all lists all {total})" in short
    assert rows[0].endswith("| chosen |")
    kinds = [_kind(r) for r in rows[1:]]
    assert {"slower", "does not fit: generate", "does not fit: update_actor"} <= set(kinds)
    for kind in set(kinds):  # three of each (all of a kind with fewer): the fastest, or the nearest to fit
        column = 5 if kind == "slower" else 4 if "host" in kind else 3  # est. step s, host GB, GB per GPU
        shown = [float(r.split("|")[column]) for r in rows[1:] if _kind(r) == kind]
        of_kind = sorted(float(r.split("|")[column]) for r in every[1:] if _kind(r) == kind)
        assert shown == of_kind[: min(3, len(of_kind))]
    assert len(rows) == 1 + sum(min(3, sum(_kind(r) == k for r in every[1:])) for k in set(kinds))


def _kind(row: str) -> str:
    """A verdict's reason without its figures: 'slower', 'does not fit: update_actor', 'does not fit: the host'."""
    verdict = row.rstrip(" |").rsplit("| ", 1)[1]
    if verdict.startswith(("slower", "as fast")):  # the ones that fit, the fastest of them first
        return "slower"
    return re.sub(r" needs .*", "", verdict)


def test_planning_for_other_gpus_says_the_host_was_not_checked_and_what_it_needs(capsys) -> None:
    """--gpus 8 --gpu-memory-gb 141 (not this machine's): the 70B plan's CPU step keeps ~988 GB per node on the
    host; without --host-memory-gb the plan says it did not check that, and how much it is."""
    argv = ["plan", "--model-shape", "llama-3-70b", "--gpus", "8", "--gpu-memory-gb", "141"]
    assert main([*argv, "data.train_batch_size=64"]) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if line.startswith("host memory per node")]
    needs = re.match(r"host memory per node \(offload, CPU step\): ([0-9.]+) GB, not checked", note)[1]
    assert float(needs) > 900 and "--host-memory-gb" in note
    first = out.splitlines()[0]
    assert (
        "offload=cpu-step" in first
        and f"host memory not checked: this layout keeps {needs} GB per node" in first
    )


def test_planning_for_this_machines_gpus_checks_its_host_memory(monkeypatch, capsys) -> None:
    """On a machine with one GPU of 141 GB and 64 GB of memory, `plan --gpus 1` plans for its GPU and checks the
    host against its memory (the 7B CPU step's 107 GB does not fit 80% of 64); --gpus 2 (more GPUs per node than
    it has) is not this machine, and the host is not checked."""
    monkeypatch.setattr(memory, "gpu_memory_bytes", lambda cap=None: 141 * 10**9)
    monkeypatch.setattr(memory, "gpus_here", lambda: 1)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * 10**9)
    argv = ["plan", "--model-shape", "qwen2.5-7b", *WORK, "--all"]
    assert main([*argv, "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "not checked" not in out and "does not fit: the host needs 107 of 51 GB per node" in out
    assert main([*argv, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "the host needs" not in out and "of 141 GB" in out.splitlines()[0]


def test_planned_keys_are_not_refused_before_the_plan_chooses_them(tmp_path: Path, capsys) -> None:
    """rollout.n=5 on 8 GPUs: 10 samples per GPU, which the default micro-batch (8) does not divide; the plan
    chooses the micro-batch, so only a value the user set is refused."""
    run = tmp_path / "run.yaml"
    run.write_text("rollout:\n  n: 5\ndata:\n  max_prompt_length: 256\n  max_response_length: 512\n")
    argv = ["plan", str(run), "--model-shape", "qwen2.5-0.5b", "--gpus", "8", "--gpu-memory-gb", "80"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    micro = int(re.search(r"actor\.ppo_micro_batch_size_per_gpu=(\d+)", out.split("config keys: ")[1])[1])
    assert 10 % micro == 0
    assert main([*argv, "actor.ppo_micro_batch_size_per_gpu=8"]) == 2  # set by the user: checked as set
    err = capsys.readouterr().err
    assert "error: actor.ppo_micro_batch_size_per_gpu: 8 does not divide the per-GPU mini-batch of 10" in err
    run.write_text(run.read_text() + "actor:\n  ppo_micro_batch_size_per_gpu: 8\n")  # in the file: the same
    assert main(argv) == 2
    assert "actor.ppo_micro_batch_size_per_gpu: 8 does not divide" in capsys.readouterr().err


def test_a_dynamic_token_budget_below_one_sequence_is_planned_not_refused(capsys) -> None:
    """use_dynamic_bsz with 4096 + 16384 tokens: the default budget (16384) holds no sequence; the plan picks one."""
    long = ["data.max_prompt_length=4096", "data.max_response_length=16384", "actor.use_dynamic_bsz=true"]
    argv = ["plan", "--model-shape", "qwen2.5-0.5b", "--gpus", "8", "--gpu-memory-gb", "80", *long]
    assert (
        main(
            [
                *argv,
                "rollout.log_prob_max_token_len_per_gpu=32768",
                "ref.log_prob_max_token_len_per_gpu=32768",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    budget = int(re.search(r"actor\.ppo_max_token_len_per_gpu=(\d+)", out.split("config keys: ")[1])[1])
    assert budget >= 4096 + 16384


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2.5-VL saved to a directory (its config.json is all the plan reads) and the model."""
    from hybridflow.models.vision import build_tiny_vl_model_and_processor

    out = tmp_path_factory.mktemp("vl") / "m"
    model, _ = build_tiny_vl_model_and_processor(out_dir=out)
    return out, model


def test_a_vision_language_model_is_planned_with_its_vision_tower(tiny_vl, capsys) -> None:
    path, model = tiny_vl
    assert main(["plan", f"model.path={path}", "--gpus", "2", "--gpu-memory-gb", "80", *WORK]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("auto layout: train_view=(fsdp=2), generate_view=(tp=1, dp=2), sp=1")
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    assert f"{total / 1e6:.2f}M parameters (vision tower {tower / 1e6:.2f}M, frozen)" in first
    # a VLM trains on FSDP2 alone and generates on whole replicas: no other view is a candidate
    assert _rows(out) and all(
        r.startswith("| train_view=(fsdp=2), generate_view=(tp=1, dp=2), sp=1,") for r in _rows(out)
    )


# Qwen3-30B-A3B by hand: hidden 2048, 48 layers, 32 heads and 4 KV heads of 128 dims (q 4096 rows, k and v
# 512), q/k norms of 128, two layer norms; a router (128 x 2048) and 128 experts of 3 x 768 x 2048 a layer;
# vocabulary 151936 in the embedding and the head; float32 masters, gradients, moments (16 bytes an element),
# bf16 generation weights (2).
A3B = dict(h=2048, layers=48, q=4096, kv=512, experts=128, expert=3 * 768 * 2048, vocab=151936)


def test_plan_prints_the_30b_a3b_expert_parallel_views_as_counted_by_hand(capsys) -> None:
    """The write-ups' TP=8, EP=2 -> TP=4 at the half scale the engine takes on 8 GPUs: training TP=8 does not
    split the 4 KV heads, and training ep divides the data-parallel ranks (1 at tp = 8), so train (tp=4, dp=2,
    ep=2) -> generate tp=2 with the experts split whole (ep=2), independent of the training ep."""
    views = ["actor.parallel.tp=4", "actor.parallel.ep=2", "rollout.tensor_model_parallel_size=2"]
    views += ["rollout.expert_parallel_size=2", "actor.fsdp.param_offload=false"]
    views += ["actor.fsdp.optimizer_offload=false", "actor.fsdp.optimizer_step_on_cpu=false"]
    argv = ["plan", "--model-shape", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory-gb", "80", *views]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "auto layout: train_view=(tp=4, pp=1, dp=2, ep=2), generate_view=(tp=2, ep=2, dp=4)"
    )
    m = A3B
    h, layers, router, experts = m["h"], m["layers"], m["experts"] * m["h"], m["experts"] * m["expert"]
    attention = 2 * m["q"] * h + 2 * m["kv"] * h  # q, o; k, v
    # training rank: the attention over tp 4 then FSDP2 over dp 2; norms, router (MoE blocks are whole on the tp
    # ranks) over dp 2; half of the experts (ep 2), not split further (dp / ep = 1); embedding and head over dp
    held = (
        layers * (attention // 8 + (2 * 128 + 2 * h) // 2 + router // 2 + experts // 2)
        + (2 * m["vocab"] + 1) * h // 2
    )
    # generation rank: the attention (2 of 4 KV heads) over tp 2, norms and router whole, 64 experts whole
    weights = layers * (attention // 2 + 2 * 128 + 2 * h + router + experts // 2) + (m["vocab"] + 1) * h
    # rank 1: tp rank 0 of the rollout (experts 0-63), training tp rank 0, dp rank 1, ep rank 1 (experts 64-127):
    # of q it holds rows 512-1023 of the 2048 it needs, of k/v rows 64-127 of 256, of o rows 1024-2047 of
    # columns 0-1023 (of 2048 x 2048), half of each norm and of the router, none of its experts, the other
    # half of the vocabulary (of the embedding and of the head), half of the final norm; the other ranks receive
    # as much or less
    per_layer = (2048 - 512) * h + 2 * (256 - 64) * h + (h * h - 1024 * 1024) + (2 * 128 + 2 * h) // 2
    received = layers * (per_layer + router // 2 + experts // 2) + m["vocab"] * h + h // 2
    gb = 1e9
    line = next(x for x in out.splitlines() if x.startswith("per GPU:"))
    assert (
        f"training state {held * 16 / gb:.2f} GB" in line
        and f"generation weights {weights * 2 / gb:.2f}" in line
    )
    assert f"{received * 2 / gb:.3f} GB received per switch" in line
    # the rollout phase: float32 masters and moments kept, the generation weights, and the KV cache of the 32
    # sequences a rollout group decodes (16 prompts x 8 / 4 groups) of 192 tokens (K and V of 2 KV heads a rank in
    # 48 layers, bf16) with a float32 logits row (half the vocabulary)
    cfg = load_config(None, [])
    seqs = cfg.data.train_batch_size * cfg.rollout.n // 4
    context = cfg.data.max_prompt_length + cfg.data.max_response_length
    kv = seqs * (context * layers * 2 * 2 * 128 * 2 + m["vocab"] * 4 // 2)
    generate = held * 12 + weights * 2 + kv
    assert not cfg.use_reference and f"| generate | {generate / gb:.2f} |" in out
