"""verl keys: mapped in overrides and YAML, one notice per key, ignored and refused keys, docs in sync."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hybridflow.config import VERL_ALIASES, ConfigError, load_config, schema_index
from hybridflow.config import aliases as aliases_module
from hybridflow.config.reference import render_into

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Records]:
    """Fresh once-per-process memory, and the alias module's log records (independent of handlers)."""
    monkeypatch.setattr(aliases_module, "_noticed", set())
    log = logging.getLogger(aliases_module.__name__)
    handler = _Records()
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(old_level)


def test_at_least_40_aliases_all_pointing_at_real_fields() -> None:
    leaves, _ = schema_index()
    assert len(VERL_ALIASES) >= 40
    assert set(VERL_ALIASES.values()) <= set(leaves)
    assert not set(VERL_ALIASES) & set(leaves)  # an alias never shadows one of our own keys


# (verl override, our dotted key, expected value) — the keys of verl's example scripts.
CASES = [
    ("data.train_batch_size=32", "data.train_batch_size", 32),
    ("data.max_prompt_length=256", "data.max_prompt_length", 256),
    ("data.max_response_length=128", "data.max_response_length", 128),
    ("data.train_files=/d/train.parquet", "data.train_files", ["/d/train.parquet"]),
    ("data.val_files=[/d/a.parquet,/d/b.parquet]", "data.val_files", ["/d/a.parquet", "/d/b.parquet"]),
    ("actor_rollout_ref.model.path=/models/qwen", "model.path", "/models/qwen"),
    ("actor_rollout_ref.rollout.n=5", "rollout.n", 5),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "rollout.gpu_memory_utilization", 0.6),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=1", "rollout.tensor_model_parallel_size", 1),
    ("actor_rollout_ref.hybrid_engine=false", "actor.hybrid_engine", False),
    (
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=64",
        "rollout.update_weights_bucket_megabytes",
        64,
    ),
    ("actor_rollout_ref.rollout.temperature=0.9", "rollout.temperature", 0.9),
    ("actor_rollout_ref.rollout.val_kwargs.n=4", "rollout.val_kwargs.n", 4),
    ("actor_rollout_ref.actor.optim.lr=3e-6", "actor.optim.lr", 3e-6),
    ("actor_rollout_ref.actor.optim.warmup_style=cosine", "actor.optim.lr_scheduler_type", "cosine"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor.ppo_mini_batch_size", 8),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor.ppo_micro_batch_size_per_gpu", 4),
    ("actor_rollout_ref.actor.use_kl_loss=True", "actor.use_kl_loss", True),
    ("actor_rollout_ref.actor.kl_loss_coef=0.01", "actor.kl_loss_coef", 0.01),
    ("actor_rollout_ref.actor.kl_loss_type=mse", "actor.kl_loss_type", "mse"),
    ("actor_rollout_ref.actor.entropy_coeff=0.001", "actor.entropy_coeff", 0.001),
    ("actor_rollout_ref.actor.clip_ratio_high=0.28", "actor.clip_ratio_high", 0.28),
    (
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "model.enable_gradient_checkpointing",
        True,
    ),
    ("actor_rollout_ref.model.use_remove_padding=True", "model.use_remove_padding", True),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor.fsdp.param_offload", True),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        "ref.log_prob_micro_batch_size_per_gpu",
        32,
    ),
    ("actor_rollout_ref.ref.fsdp_config.param_offload=True", "ref.fsdp.param_offload", True),
    ("critic.optim.lr=2e-5", "critic.optim.lr", 2e-5),
    ("critic.model.path=/models/critic", "critic.model.path", "/models/critic"),
    ("critic.model.fsdp_config.optimizer_offload=True", "critic.fsdp.optimizer_offload", True),
    ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator", "rloo"),
    ("algorithm.kl_ctrl.kl_coef=0.002", "algorithm.kl_ctrl.kl_coef", 0.002),
    ("algorithm.use_kl_in_reward=True", "algorithm.use_kl_in_reward", True),
    ("trainer.total_epochs=15", "trainer.total_epochs", 15),
    ("trainer.logger=['console','wandb']", "trainer.logger", ["console", "wandb"]),
    ("trainer.project_name='verl_grpo_example_gsm8k'", "trainer.project_name", "verl_grpo_example_gsm8k"),
    ("trainer.critic_warmup=0", "trainer.critic_warmup", 0),
    ("trainer.max_actor_ckpt_to_keep=3", "trainer.max_ckpt_to_keep", 3),
    ("custom_reward_function.path=/r/fn.py", "reward.custom_function.path", "/r/fn.py"),
    ("custom_reward_function.name=my_score", "reward.custom_function.name", "my_score"),
    ("reward_model.micro_batch_size_per_gpu=8", "reward.model.micro_batch_size_per_gpu", 8),
    ("reward_model.model.path=/models/rm", "reward.model.path", "/models/rm"),
    ("reward_model.overlong_buffer.len=16", "reward.overlong_buffer.len", 16),
    ("reward_model.launch_reward_fn_async=True", "reward.launch_async", True),
    ("actor_rollout_ref.nccl_timeout=1200", "trainer.nccl_timeout", 1200),
    ("actor_rollout_ref.actor.use_torch_compile=False", "actor.use_torch_compile", False),
]


@pytest.mark.parametrize(("override", "ours", "expected"), CASES, ids=[c[0].split("=")[0] for c in CASES])
def test_verl_override(override: str, ours: str, expected: object) -> None:
    cfg = load_config(overrides=[override])
    value = cfg
    for part in ours.split("."):
        value = getattr(value, part)
    assert value == expected


def test_verl_keys_as_nested_yaml(tmp_path: Path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n"
        "  model:\n    path: /models/qwen\n    override_config:\n      rope_theta: 5000\n"
        "  actor:\n    optim:\n      lr: 1e-6\n    fsdp_config:\n      param_offload: true\n"
        "  rollout:\n    name: vllm\n    n: 4\n"
        "    val_kwargs:\n      do_sample: true\n      temperature: 0.6\n"
        "custom_reward_function:\n  path: fn.py\n"
        "reward_model:\n  enable: true\n  model:\n    path: /models/rm\n"
        "trainer:\n  max_critic_ckpt_to_keep: 2\n"
    )
    cfg = load_config(str(path))
    assert cfg.model.path == "/models/qwen" and cfg.model.override_config == {"rope_theta": 5000}
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.fsdp.param_offload is True
    assert cfg.rollout.engine == "native" and cfg.rollout.n == 4
    assert cfg.rollout.val_kwargs.do_sample is True and cfg.rollout.val_kwargs.temperature == 0.6
    assert cfg.reward.custom_function.path == "fn.py"
    assert cfg.reward.model.enable is True and cfg.reward.model.path == "/models/rm"
    assert cfg.trainer.max_ckpt_to_keep == 2


@pytest.mark.parametrize(("verl_value", "ours"), [("vllm", "native"), ("sglang", "native"), ("hf", "hf")])
def test_rollout_name_value_translation(verl_value: str, ours: str) -> None:
    assert load_config(overrides=[f"actor_rollout_ref.rollout.name={verl_value}"]).rollout.engine == ours


MAPPED_LINE = "verl keys and short spellings read as hybridflow's: "


def test_one_line_lists_the_mapped_keys_once_per_key(notices: _Records) -> None:
    load_config(overrides=["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=1e-5"])
    load_config(overrides=["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0.7"])
    load_config(overrides=["actor_rollout_ref.rollout.n=2"])
    assert notices.messages() == [
        MAPPED_LINE + "'actor_rollout_ref.rollout.n' -> 'rollout.n', "
        "'actor_rollout_ref.actor.optim.lr' -> 'actor.optim.lr'",
        MAPPED_LINE + "'actor_rollout_ref.rollout.temperature' -> 'rollout.temperature'",
    ]
    assert all(r.levelno == logging.INFO for r in notices.records)


# verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh): 12 of its keys are verl's own spellings
VERL_GRPO = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=1024",
    "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "trainer.n_gpus_per_node=8",
]


def test_a_verl_command_line_logs_one_line_for_its_keys(notices: _Records) -> None:
    load_config(overrides=VERL_GRPO)
    (message,) = notices.messages()
    listed = message.removeprefix(MAPPED_LINE).split(", ")
    assert len(listed) == 12 and listed[0] == "'actor_rollout_ref.model.path' -> 'model.path'"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("key", ["actor_rollout_ref.rollout.name", "rollout.engine"])
def test_vllm_and_sglang_say_the_built_in_engine_replaces_them(
    notices: _Records, engine: str, key: str
) -> None:
    assert load_config(overrides=[f"{key}={engine}"]).rollout.engine == "native"
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    replaced = (
        f"{key}={engine}: the built-in rollout engine replaces {name} here (it generates from the trainer's "
        "own weights, nothing to install); running as rollout.engine=native"
    )
    (warning,) = [r for r in notices.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == replaced


def test_shorthands(notices: _Records) -> None:
    cfg = load_config(overrides=["actor.lr=2e-6", "critic.lr=3e-5"])
    assert cfg.actor.optim.lr == 2e-6 and cfg.critic.optim.lr == 3e-5
    assert notices.messages() == [
        MAPPED_LINE + "'actor.lr' -> 'actor.optim.lr', 'critic.lr' -> 'critic.optim.lr'"
    ]


def test_our_own_keys_log_nothing(notices: _Records) -> None:
    load_config(overrides=["rollout.n=4", "trainer.total_epochs=2"])
    assert notices.records == []


def test_ignored_verl_key_warns_and_changes_nothing(notices: _Records) -> None:
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.actor.fsdp_config.grad_offload=False",
            "actor_rollout_ref.rollout.mode=sync",
        ]
    )
    assert cfg == load_config()
    assert [r.levelno for r in notices.records] == [logging.WARNING, logging.WARNING]
    assert "verl key 'actor_rollout_ref.actor.fsdp_config.grad_offload' ignored" in notices.messages()[0]


A = "actor_rollout_ref"

# Every verl key without a field here, with the values that ask for what hybridflow does anyway (accepted,
# with a notice saying how it behaves) and a value that asks for something it does not do (refused).
# (key, accepted values, words of the notice, refused value or None, words of the message, words of the fix)
IGNORED_CASES = [
    (
        f"{A}.actor.strategy",
        ["fsdp", "fsdp2", "megatron"],
        "the actor trains with FSDP2 over the data-parallel ranks and, as Megatron does, tensor parallelism "
        "inside each layer (actor.tensor_parallel_size) and pipeline stages (actor.pipeline_parallel_size)",
        "deepspeed",
        "FSDP2, with Megatron-style tensor and pipeline parallelism",
        f"set {A}.actor.strategy=fsdp2, fsdp or megatron",
    ),
    (
        f"{A}.ref.strategy",
        ["fsdp", "fsdp2", "megatron"],
        "the reference runs with FSDP2 over the data-parallel ranks and, as Megatron does, tensor parallelism "
        "inside each layer (ref.tensor_parallel_size)",
        "deepspeed",
        "FSDP2, with Megatron-style tensor and pipeline parallelism",
        f"set {A}.ref.strategy=fsdp2, fsdp or megatron",
    ),
    (
        "critic.strategy",
        ["fsdp", "fsdp2", "megatron"],
        "the critic trains with FSDP2 over the data-parallel ranks and, as Megatron does, tensor parallelism "
        "inside each layer (critic.tensor_parallel_size)",
        "deepspeed",
        "FSDP2, with Megatron-style tensor and pipeline parallelism",
        "set critic.strategy=fsdp2, fsdp or megatron",
    ),
    (
        "reward_model.strategy",
        ["fsdp", "fsdp2"],
        "whole copy",
        "megatron",
        "tensor/pipeline",
        "set reward_model.strategy=fsdp2 (or fsdp)",
    ),
    (
        f"{A}.actor.entropy_from_logits_with_chunking",
        [True, False],
        "row chunks",
        "yes",
        "true or false",
        "true or false",
    ),
    (f"{A}.actor.entropy_checkpointing", [True, False], "recomputed", 1, "true or false", "true or false"),
    (
        f"{A}.actor.fsdp_config.grad_offload",
        [False],
        "freed after every optimizer step",
        True,
        "gradients are not offloaded",
        "actor.fsdp.param_offload=true and/or actor.fsdp.optimizer_offload=true",
    ),
    (
        "critic.model.fsdp_config.grad_offload",
        [False],
        "freed after every optimizer step",
        True,
        "gradients are not offloaded",
        "critic.fsdp.param_offload=true and/or critic.fsdp.optimizer_offload",
    ),
    (
        f"{A}.ref.fsdp_config.optimizer_offload",
        [True, False],
        "the reference has no optimizer",
        "auto",
        "true or false",
        "true or false",
    ),
    (
        f"{A}.rollout.mode",
        ["sync", "async"],
        "in place of verl's sync",
        "server",
        "sync or async",
        "sync or async",
    ),
    (f"{A}.rollout.enable_chunked_prefill", [True, False], "rollout.max_num_batched_tokens", None, "", ""),
    (f"{A}.rollout.load_format", ["dummy_dtensor", "auto", "safetensors"], "weights in place", None, "", ""),
    (f"{A}.model.use_shm", [False], "load from model.path", True, "shared memory", "/dev/shm yourself"),
    (
        f"{A}.model.use_liger",
        [False],
        "Liger kernels are not used",
        True,
        "Liger kernels are not used",
        "set it to false",
    ),
    ("critic.model.lora_rank", [0], "the critic trains every weight", 8, "LoRA on the critic", "set it to 0"),
    (f"{A}.model.use_fused_kernels", [True, False], "fused", None, "", ""),
    ("data.dataloader_num_workers", [0, 8], "tokenised up front", None, "", ""),
    (
        "trainer.default_hdfs_dir",
        [None, ""],
        "trainer.default_local_dir",
        "hdfs://ckpt/run",
        "uploading checkpoints to HDFS",
        "copy them from there",
    ),
    ("trainer.del_local_ckpt_after_load", [False], "kept", True, "deleting", "trainer.max_ckpt_to_keep"),
]


def _override(key: str, value: object) -> str:
    """``key=value`` with the value written as YAML (true, null, '')."""
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def test_the_cases_cover_every_ignored_key() -> None:
    assert [c[0] for c in IGNORED_CASES] == list(aliases_module.VERL_IGNORED)
    # the 20th, hybrid_engine, is actor.hybrid_engine now; the 21st, ref.ulysses_sequence_parallel_size, is
    # ref.ulysses_sequence_parallel_size
    assert len(IGNORED_CASES) == 19


ACCEPTED = [(c[0], value, c[2]) for c in IGNORED_CASES for value in c[1]]


@pytest.mark.parametrize(("key", "value", "words"), ACCEPTED, ids=[f"{a[0]}={a[1]}" for a in ACCEPTED])
def test_a_value_we_honour_anyway_is_accepted_with_a_notice(
    notices: _Records, key: str, value: object, words: str
) -> None:
    assert load_config(overrides=[_override(key, value)]) == load_config()
    (message,) = notices.messages()
    assert message.startswith(f"verl key '{key}' ignored: ") and words in message
    assert message.endswith(f"(value {value!r})")


REFUSED = [(c[0], c[3], c[4], c[5]) for c in IGNORED_CASES if c[3] is not None]


@pytest.mark.parametrize(("key", "value", "words", "fix"), REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_a_value_asking_for_what_we_do_not_do_is_refused(
    key: str, value: object, words: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[_override(key, value)])
    (problem,) = info.value.problems
    assert problem.path == key and problem.message.startswith(f"{value!r} is ")
    assert words in problem.message and fix in problem.fix


def test_another_strategy_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{A}.actor.strategy=deepspeed"])
    assert str(info.value) == (
        f"{A}.actor.strategy: 'deepspeed' is not supported: hybridflow trains with FSDP2, with "
        "Megatron-style tensor and pipeline parallelism on top (the role's parallel section); "
        f"fix: set {A}.actor.strategy=fsdp2, fsdp or megatron (all three mean this), or remove it"
    )


def test_verls_megatron_keys_set_the_training_views() -> None:
    cfg = load_config(
        overrides=[
            f"{A}.actor.strategy=megatron",
            f"{A}.actor.megatron.tensor_model_parallel_size=2",
            f"{A}.ref.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=2",
            "trainer.n_gpus_per_node=4",
        ]
    )
    assert (
        cfg.actor.tensor_parallel_size == cfg.ref.tensor_parallel_size == cfg.critic.tensor_parallel_size == 2
    )


def test_ignored_keys_as_nested_yaml_are_judged_by_value(tmp_path: Path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  hybrid_engine: true\n  actor:\n    strategy: fsdp\n"
        "  rollout:\n    mode: async\n    name: vllm\ncritic:\n  strategy: deepspeed\n"
        "trainer:\n  default_hdfs_dir: null\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert [p.path for p in info.value.problems] == ["critic.strategy"]


def test_all_refusals_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{A}.model.use_shm=true", "trainer.default_hdfs_dir=/hdfs/x", "rollout.n=0"])
    assert [p.path for p in info.value.problems] == [f"{A}.model.use_shm", "trainer.default_hdfs_dir"]


def test_docs_list_every_ignored_key_with_its_accepted_values() -> None:
    doc = DOC.read_text()
    for key, entry in aliases_module.VERL_IGNORED.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{key}` |"))
        assert entry.notice in row
        if entry.fix:
            assert entry.fix.format(key=key) in row


def test_global_micro_batch_is_refused_with_the_conversion() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["actor_rollout_ref.actor.ppo_micro_batch_size=128"])
    message = str(info.value)
    assert message.startswith("actor_rollout_ref.actor.ppo_micro_batch_size: ")
    assert "actor.ppo_micro_batch_size_per_gpu" in message and "n_gpus_per_node" in message


def test_type_error_names_the_verl_key() -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout\.n \(given as 'actor_rollout_ref\.rollout\.n'\): expected an integer"
    ):
        load_config(overrides=["actor_rollout_ref.rollout.n=abc"])


def test_range_error_names_the_verl_key() -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout\.n \(given as 'actor_rollout_ref\.rollout\.n'\): must be at least 1"
    ):
        load_config(overrides=["actor_rollout_ref.rollout.n=0"])


def test_docs_list_every_alias() -> None:
    doc = DOC.read_text()
    missing = [key for key in VERL_ALIASES if f"`{key}`" not in doc]
    assert not missing, (
        f"docs/config.md lacks {missing}; run python -m hybridflow.config.reference docs/config.md"
    )


def test_docs_generated_blocks_are_current() -> None:
    doc = DOC.read_text()
    assert render_into(doc) == doc, "run: python -m hybridflow.config.reference docs/config.md"
    leaves, _ = schema_index()
    assert all(f"`{path}`" in doc for path in leaves)


def test_render_into_refuses_a_document_without_markers() -> None:
    with pytest.raises(ValueError, match="no generated block"):
        render_into("# nothing here\n")
