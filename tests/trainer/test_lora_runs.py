"""LoRA end to end (issue 46): GRPO, SFT, DPO and KTO train adapters only, on Qwen2 and Llama.

The reference is the actor's base with its adapters off (no copy), the rollout generates with the merged
W + (alpha / r) B A (its log-probs equal the trainer's in float32), checkpoints hold the adapters and resume
exactly, and export writes the merged model or PEFT's adapter. At one rank in this process, at two gloo ranks
(the merged sources through the reshard plan) in kept processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.dist_util import run_world_kept
from support.realistic import realistic_rows, write_jsonl

from hybridflow.checkpoint.export import export_adapter, load_adapted, load_role_model
from hybridflow.checkpoint.manager import read_meta
from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.engine.ops.tensors import local_shard
from hybridflow.engine.parallel.lora import LoraSpec, apply_lora
from hybridflow.models import build_tiny_model_and_tokenizer, load_causal_lm
from hybridflow.protocol import Batch
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.utils.errors import UserError
from hybridflow.workers.reference import AdapterReference, ReferenceWorker

REWARD_SOURCE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 11 / 10
"""
FAMILIES = ("qwen2", "llama")
LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.target_modules=all-linear"]
GRPO = [
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=400",
    "data.max_response_length=6",
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor.optim.lr=1e-2",
    "actor.use_kl_loss=true",
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
    "trainer.logger=[console]",
    *LORA,
]
PREFERENCE = [
    "data.train_batch_size=4",
    "data.max_prompt_length=24",
    "data.max_response_length=12",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "actor.optim.lr=1e-2",
    "trainer.total_training_steps=2",
    "trainer.logger=[console]",
    *LORA,
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen2, Llama, GPT-2 and Qwen2-MoE models on disk, RL prompts, preference and KTO rows, SFT rows."""
    root = tmp_path_factory.mktemp("lora")
    out = {
        "train": write_jsonl(realistic_rows(8, seed=3), root / "train.jsonl"),
        "reward": root / "reward.py",
    }
    out["reward"].write_text(REWARD_SOURCE)
    for name in (*FAMILIES, "gpt2", "qwen2_moe"):
        build_tiny_model_and_tokenizer(out_dir=root / name, arch=name, hidden_size=32, num_hidden_layers=1)
        out[name] = root / name
    pairs = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "chosen": f"{i + 1}", "rejected": f"{i + 2}"}
        for i in range(8)
    ]
    kto = [{"prompt": f"{i}+1=", "completion": f"{i + 1 + (i % 2)}", "label": i % 2 == 0} for i in range(8)]
    sft = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "response": f"#### {i + 1}"} for i in range(8)
    ]
    for name, rows in (("pairs", pairs), ("kto", kto), ("sft", sft)):
        out[name] = write_jsonl(rows, root / f"{name}.jsonl")
    return out


def grpo_args(setup: dict[str, Path], family: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={setup[family]}",
        f"data.train_files=[{setup['train']}]",
        f"reward.custom_function.path={setup['reward']}",
        f"trainer.default_local_dir={run_dir}",
        *GRPO,
        *extra,
    ]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_grpo(steps: list[dict]) -> None:
    """Step 1 on-policy with a zero adapter (the policy is the reference); step 2 after an update: the KL to
    the base is positive and the merged rollout's log-probs still equal the trainer's."""
    first, second = steps
    assert first["actor/ppo_kl"] == 0.0 and first["actor/kl_loss"] == 0.0
    assert second["actor/kl_loss"] > 0
    for m in steps:
        assert m["rollout_corr/log_prob_abs_diff_max"] <= 1e-5


def local_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: local_shard(p).clone() for n, p in module.named_parameters()}


def scoring_batch(vocab: int, rows: int = 4, prompt: int = 5, response: int = 4) -> Batch:
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + response))
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
            "responses": ids[:, prompt:],
            "response_mask": torch.ones(rows, response, dtype=torch.long),
        }
    )


@pytest.mark.parametrize(
    "family,merge,engine",
    [
        ("qwen2", "buffer", "native"),
        ("llama", "buffer", "native"),
        ("qwen2", "in_place", "native"),
        ("llama", "buffer", "hf"),
    ],
)
def test_grpo_trains_only_the_adapters_against_the_base_as_reference(
    setup: dict[str, Path], tmp_path: Path, family: str, merge: str, engine: str
) -> None:
    # in_place: the rollout reads the base's own storage, merged for the generation and copied back after;
    # hf: HF generate on the rollout's own replica, refreshed through the switch's merged sources
    extra = ("trainer.save_freq=1", f"rollout.lora_merge={merge}", f"rollout.engine={engine}")
    cfg = load_config(None, grpo_args(setup, family, tmp_path / "run", *extra))
    components = build_components(cfg)
    roles = components.groups[0].worker.roles
    actor = roles["actor"]
    assert isinstance(roles["ref"], AdapterReference)  # no second copy of the model
    assert (actor.hybrid.in_place is not None) == (merge == "in_place")
    before = local_params(actor.engine.module)
    check_grpo(PPOTrainer(cfg, components).fit())
    after = local_params(actor.engine.module)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert any(".lora_B." in n for n in changed)
    # The reference pass (adapters off) equals a reference worker on the base model, bit for bit.
    batch = scoring_batch(actor.hf_model.config.vocab_size)
    ours = roles["ref"].compute_ref_log_prob(batch)["ref_log_prob"]
    theirs = ReferenceWorker(load_causal_lm(setup[family]), cfg).compute_ref_log_prob(batch)["ref_log_prob"]
    assert torch.equal(ours, theirs)
    adapted = actor.compute_log_prob(batch)["old_log_probs"]
    assert not torch.equal(adapted, ours)  # the adapters are on again after the reference pass
    saved = read_meta(tmp_path / "run" / "global_step_2")["roles"]["actor"]
    assert saved["lora"]["rank"] == 4 and "self_attn.q_proj" in saved["lora"]["target_modules"]


def test_a_lora_checkpoint_resumes_exactly_and_exports(setup: dict[str, Path], tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    assert main(["train", *grpo_args(setup, "qwen2", straight, "trainer.save_freq=1")]) == 0
    resumed = tmp_path / "resumed"
    args = grpo_args(setup, "qwen2", resumed, f"trainer.resume={straight / 'global_step_1'}")
    assert main(["train", *args]) == 0
    want, got = metrics(straight), metrics(resumed)
    assert [m["step"] for m in got] == [2]
    for key, value in want[1].items():
        if not key.startswith(("timing_s/", "perf/", "memory/")):
            assert got[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # The export is the merged model: its logits equal the base wrapped with the saved adapters.
    ckpt = straight / "global_step_2"
    merged = load_role_model(ckpt)
    meta = read_meta(ckpt)
    wrapped, adapters = load_adapted(ckpt, meta, "actor")
    lora = meta["roles"]["actor"]["lora"]
    spec = LoraSpec(lora["rank"], lora["alpha"], tuple(lora["target_modules"]))
    apply_lora(wrapped, list(wrapped.model.layers), spec)
    missing, unexpected = wrapped.load_state_dict(adapters, strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing)
    ids = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, wrapped(ids).logits, atol=1e-5, rtol=0)
        base_logits = load_causal_lm(setup["qwen2"])(ids).logits
    assert not torch.allclose(merged(ids).logits, base_logits)
    peft = pytest.importorskip("peft")
    out = export_adapter(ckpt, tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    model = peft.PeftModel.from_pretrained(load_causal_lm(setup["qwen2"]), out)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, wrapped(ids).logits, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def lora_run(setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA GRPO run of one step on Qwen2 with its checkpoint, global_step_1."""
    run = tmp_path_factory.mktemp("lora_run") / "run"
    args = grpo_args(setup, "qwen2", run, "trainer.save_freq=1", "trainer.total_training_steps=1")
    assert main(["train", *args]) == 0
    return run


def test_resuming_with_another_lora_alpha_is_refused_naming_both_values(
    setup: dict[str, Path], lora_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 59: the adapter's scale went from alpha / r = 2 to 16 without a word
    capsys.readouterr()
    assert main(["train", *grpo_args(setup, "qwen2", lora_run, "model.lora_alpha=64")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {lora_run / 'global_step_1'} was trained with")
    err = errors[0]
    assert "model.lora_alpha was 8.0 there and is 64.0 here. Resume it with model.lora_alpha=8.0, or" in err
    assert [m["step"] for m in metrics(lora_run)] == [1]  # nothing trained, nothing overwritten


def test_export_overwrite_replaces_the_directory_whole_and_says_so_once(
    lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    # issue 59: a merged export over an adapter-only one kept adapter_config.json, so transformers loaded
    # the base with the stale adapter instead of the merged weights
    from transformers import AutoModelForCausalLM

    ckpt, out = lora_run / "global_step_1", tmp_path / "out"
    assert main(["export", str(lora_run), "--out", str(out), "--adapter-only"]) == 0
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    capsys.readouterr()
    assert main(["export", str(lora_run), "--out", str(out), "--overwrite"]) == 0
    said = capsys.readouterr()
    assert (said.out + said.err).count(f"exported the actor of {ckpt} to {out}") == 1
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not names & {"adapter_config.json", "adapter_model.safetensors"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old copy left beside it
    ids = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        want = load_role_model(ckpt)(ids).logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(ids).logits, want)
    assert main(["export", str(lora_run), "--out", str(out), "--overwrite", "--adapter-only"]) == 0
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}


@pytest.mark.parametrize("family", ["gpt2", "qwen2_moe"])
def test_a_family_without_lora_is_refused_by_name(
    setup: dict[str, Path], tmp_path: Path, family: str
) -> None:
    cfg = load_config(None, grpo_args(setup, family, tmp_path / "run", "trainer.save_freq=-1"))
    with pytest.raises(
        UserError, match=f"model.lora_rank: LoRA is built for the dense families llama, .*not for '{family}'"
    ):
        build_components(cfg)


def preference_args(cmd: str, setup: dict[str, Path], family: str, run_dir: Path) -> list[str]:
    data = setup["pairs" if cmd == "dpo" else "kto"]
    return [
        cmd,
        f"model.path={setup[family]}",
        f"data.train_files=[{data}]",
        f"trainer.default_local_dir={run_dir}",
        *PREFERENCE,
    ]


def check_preference(cmd: str, steps: list[dict]) -> None:
    assert [m["step"] for m in steps] == [1, 2]
    if cmd == "dpo":  # a zero adapter: the policy is the reference at step 1
        assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
        assert steps[1]["rewards/margins"] != 0.0
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in steps)


@pytest.mark.parametrize("cmd", ["dpo", "kto"])
def test_dpo_and_kto_with_lora_at_one_rank(setup: dict[str, Path], tmp_path: Path, cmd: str) -> None:
    assert main(preference_args(cmd, setup, "llama", tmp_path / "run")) == 0
    check_preference(cmd, metrics(tmp_path / "run"))
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()  # merged: plain HF names


def test_sft_with_lora_writes_the_merged_model(setup: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "sft_model"
    args = [f"model.path={setup['qwen2']}", f"data.train_files=[{setup['sft']}]", "data.train_batch_size=4"]
    args += ["actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-2", "trainer.total_training_steps=2", *LORA]
    assert main(["sft", *args, f"trainer.default_local_dir={tmp_path / 'run'}", "--out", str(out)]) == 0
    base, tuned = load_causal_lm(setup["qwen2"]), load_causal_lm(out)
    moved = [n for n, p in tuned.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert moved and all("layers" in n and "proj" in n for n in moved)  # only the adapted linears


def run_on_rank(rank: int, runs: list[list[str]]) -> list[int]:
    return [main(args) for args in runs]


@pytest.mark.slow
def test_grpo_dpo_and_kto_with_lora_on_two_ranks(setup: dict[str, Path], tmp_path: Path) -> None:
    two = ["trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=2"]
    # GRPO with a whole replica per rank, and with a tensor-parallel rollout (tp = 2: merged shards)
    cases = [("train", f) for f in FAMILIES] + [("tp", "llama"), ("dpo", "qwen2"), ("kto", "llama")]
    runs = []
    for cmd, family in cases:
        run_dir = tmp_path / f"{cmd}-{family}"
        if cmd in ("train", "tp"):
            tp = "rollout.tensor_model_parallel_size=" + ("2" if cmd == "tp" else "1")
            runs.append(["train", *grpo_args(setup, family, run_dir, "trainer.save_freq=-1", tp, *two)])
        else:
            runs.append([*preference_args(cmd, setup, family, run_dir), *two])
    codes = run_world_kept(2, run_on_rank, runs, timeout=600)
    assert codes == [[0] * len(cases)] * 2
    for cmd, family in cases:
        steps = metrics(tmp_path / f"{cmd}-{family}")
        check_grpo(steps) if cmd in ("train", "tp") else check_preference(cmd, steps)
