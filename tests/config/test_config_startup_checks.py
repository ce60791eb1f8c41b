"""Settings that used to pass validation and fail at the first step (issue 25): each is now either given
the behaviour its help text documents or refused at start, naming the field and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hybridflow.config import Config, ConfigError, load_config, schema_index, validate_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return info.value


# --- rollout_rs without a threshold: null means rollout_is_threshold, as the help says ------------------

RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("mode", ["token", "sequence", "geometric"])
def test_rollout_rs_without_a_threshold_rejects_at_rollout_is_threshold(mode: str) -> None:
    rc = load_config(overrides=[f"{RC}.rollout_rs={mode}"]).algorithm.rollout_correction
    assert rc.rollout_rs_threshold == rc.rollout_is_threshold == 2.0
    rc = load_config(overrides=[f"{RC}.rollout_rs={mode}", f"{RC}.rollout_is_threshold=3.5"]).algorithm
    assert rc.rollout_correction.rollout_rs_threshold == 3.5


def test_rollout_rs_threshold_given_or_rejection_off_is_left_alone() -> None:
    rc = load_config(overrides=[f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=1.5"])
    assert rc.algorithm.rollout_correction.rollout_rs_threshold == 1.5
    assert load_config().algorithm.rollout_correction.rollout_rs_threshold is None  # no rejection: null
    assert schema_index()[0][f"{RC}.rollout_rs_threshold"].help.startswith(
        "Upper rejection threshold; null = rollout_is_threshold"
    )


def test_rollout_rs_threshold_default_holds_for_a_python_built_section() -> None:
    from hybridflow.config.schema import RolloutCorrectionConfig

    assert RolloutCorrectionConfig(rollout_rs="token", rollout_is_threshold=4.0).rollout_rs_threshold == 4.0


def test_rollout_rs_threshold_cleared_after_construction_is_refused() -> None:
    cfg = Config()
    cfg.algorithm.rollout_correction.rollout_rs = "token"  # set after construction: nothing resolved it
    problems = validate_config(cfg)
    assert [str(p) for p in problems] == [
        f"{RC}.rollout_rs_threshold: is null while {RC}.rollout_rs='token'; "
        f"fix: set {RC}.rollout_rs_threshold=2.0 (rollout_is_threshold, its documented default), or "
        f"{RC}.rollout_rs=null"
    ]


@pytest.mark.parametrize(
    ("old", "new"), [("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")]
)
def test_older_rollout_rs_names_are_aliases_of_verl_options(old: str, new: str) -> None:
    rc = load_config(overrides=[f"{RC}.rollout_rs={old}"]).algorithm.rollout_correction
    assert rc.rollout_rs == new
    chained = load_config(
        overrides=[f"{RC}.rollout_rs={old},seq_max_k2,{new}", f"{RC}.rollout_rs_threshold=2.0"]
    )
    assert chained.algorithm.rollout_correction.rollout_rs == f"{new},seq_max_k2"


def test_rollout_correction_accepts_verl_threshold_strings() -> None:
    rc = load_config(
        overrides=[
            f"{RC}.rollout_is=token",
            f"{RC}.rollout_is_threshold=0.5_5.0",
            f"{RC}.rollout_rs=token_k1,seq_mean_k3",
            f"{RC}.rollout_rs_threshold='0.8_1.25,0.1'",
        ]
    ).algorithm.rollout_correction
    assert (rc.rollout_is_threshold, rc.rollout_rs_threshold) == ("0.5_5.0", "0.8_1.25,0.1")


def test_the_deprecated_lower_bound_becomes_the_equal_verl_spec() -> None:
    # old: keep pi_train / pi_rollout in [0.8, 2]; verl's k1 bounds are on the reciprocal: [0.5, 1.25]
    rc = load_config(overrides=[f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold_lower=0.8"])
    assert rc.algorithm.rollout_correction.rollout_rs_threshold == "0.5_1.25"
    assert rc.algorithm.rollout_correction.rollout_rs_threshold_lower is None
    error = _error([f"{RC}.rollout_rs=seq_max_k2", f"{RC}.rollout_rs_threshold_lower=0.8"])
    assert [p.path for p in error.problems] == [f"{RC}.rollout_rs_threshold_lower"]
    assert "k1 options only" in str(error)


@pytest.mark.parametrize(
    ("overrides", "path", "words"),
    [
        (
            [f"{RC}.rollout_rs=tokens"],
            f"{RC}.rollout_rs",
            ["'tokens'", "token_k1", "seq_max_k3", "geometric=seq_mean_k1"],
        ),
        ([f"{RC}.rollout_rs=token_k1,seq_max_k1"], f"{RC}.rollout_rs", ["'seq_max_k1'", "seq_max_k2"]),
        (
            [f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=0.5_2.0"],
            f"{RC}.rollout_rs_threshold",
            ["k2/k3"],
        ),
        (
            [f"{RC}.rollout_rs=token_k1,token_k2", f"{RC}.rollout_rs_threshold='1,2,3'"],
            f"{RC}.rollout_rs_threshold",
            ["one per option"],
        ),
        ([f"{RC}.rollout_is_threshold=big"], f"{RC}.rollout_is_threshold", ["IcePop"]),
        ([f"{RC}.rollout_is_threshold=0"], f"{RC}.rollout_is_threshold", ["> 0"]),
    ],
)
def test_bad_rollout_correction_values_name_the_field_and_the_options(
    overrides: list[str], path: str, words: list[str]
) -> None:
    error = _error(overrides)
    assert isinstance(error, ValueError)
    assert [p.path for p in error.problems] == [path]
    for word in words:
        assert word in str(error)


# --- token budgets smaller than one sequence ---------------------------------------------------------

# (switch, budget, extra overrides that make the role exist); the default lengths are 128 + 64 = 192.
BUDGETS = [
    ("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu", []),
    ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", ["algorithm.adv_estimator=gae"]),
    ("rollout.log_prob_use_dynamic_bsz", "rollout.log_prob_max_token_len_per_gpu", []),
    ("ref.log_prob_use_dynamic_bsz", "ref.log_prob_max_token_len_per_gpu", ["actor.use_kl_loss=true"]),
]


@pytest.mark.parametrize(("switch", "budget", "extra"), BUDGETS, ids=[b[1] for b in BUDGETS])
def test_a_token_budget_below_one_sequence_is_refused(switch: str, budget: str, extra: list[str]) -> None:
    message = str(_error([*extra, f"{switch}=true", f"{budget}=191"]))
    assert message == (
        f"{budget}: 191 tokens cannot hold one sequence of data.max_prompt_length + "
        f"data.max_response_length = 192 tokens while {switch}=true; "
        f"fix: set {budget} to at least 192 (or {switch}=false)"
    )
    assert load_config(overrides=[*extra, f"{switch}=true", f"{budget}=192"])  # exactly one sequence fits
    assert load_config(overrides=[*extra, f"{switch}=false", f"{budget}=191"])  # the budget is not used


def test_the_budget_follows_the_lengths_and_names_the_verl_key() -> None:
    message = str(
        _error(
            [
                "data.max_prompt_length=1024",
                "data.max_response_length=1024",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2000",
            ]
        )
    )
    assert message.startswith(
        "actor.ppo_max_token_len_per_gpu (given as 'actor_rollout_ref.actor.ppo_max_token_len_per_gpu'): "
        "2000 tokens cannot hold one sequence of data.max_prompt_length + data.max_response_length = 2048"
    )


def test_the_critic_budget_counts_only_with_a_critic() -> None:
    cfg = load_config(overrides=["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=10"])
    assert not cfg.use_critic


# --- empty file lists ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["data.train_files", "data.val_files"])
def test_an_empty_file_list_is_refused(field: str) -> None:
    message = str(_error([f"{field}=[]"]))
    assert message.startswith(f"{field}: is an empty list; fix: ")
    assert f"{field}=[FILE,...]" in message and f"{field}=null" in message


def test_an_empty_file_list_in_yaml_is_refused(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_files: [/d/train.parquet]\n  val_files: []\n")
    with pytest.raises(ConfigError, match=r"^data\.val_files: is an empty list"):
        load_config(str(path))
    leaves, _ = schema_index()
    assert "an empty list is an error" in leaves["data.train_files"].help
    assert "an empty list is an error" in leaves["data.val_files"].help


def test_file_lists_and_null_pass() -> None:
    cfg = load_config(overrides=["data.train_files=[/d/a.parquet]", "data.val_files=null"])
    assert cfg.data.train_files == ["/d/a.parquet"] and cfg.data.val_files is None


# --- a rollout dtype other than the training compute dtype: refused unless opted in (issue 38) ----------


@pytest.fixture
def validate_warnings(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The dtype check's warnings (the CLI's console logging stops propagation at 'hybridflow')."""
    monkeypatch.setattr(logging.getLogger("hybridflow"), "propagate", True)

    def messages(overrides: list[str]) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybridflow.config.dtypes"):
            load_config(overrides=overrides)
        return [r.getMessage() for r in caplog.records if r.name == "hybridflow.config.dtypes"]

    return messages


MISMATCHES = [
    (["rollout.dtype=float16"], "auto", "bfloat16 on GPU, float32 on CPU"),
    (["rollout.dtype=fp16", "trainer.device=cuda"], "auto", "bfloat16 on GPU"),
    (["rollout.dtype=float16", "actor.fsdp.param_dtype=bf16"], "bf16", "bfloat16"),
    (["rollout.dtype=bfloat16", "trainer.device=cpu"], "auto", "float32 on CPU"),
    (["rollout.dtype=float32", "actor.fsdp.param_dtype=bfloat16"], "bfloat16", "bfloat16"),
]


@pytest.mark.parametrize(("overrides", "param", "compute"), MISMATCHES)
def test_a_rollout_dtype_off_the_training_compute_dtype_is_refused_naming_both_keys(
    overrides: list[str], param: str, compute: str
) -> None:
    (problem,) = _error(overrides).problems
    rollout = overrides[0].split("=")[1]
    assert problem.path == "rollout.dtype"
    assert problem.message.startswith(
        f"{rollout} is not the training compute dtype (actor.fsdp.param_dtype={param}: {compute}): "
        "the rollout's log-probs would differ from the trainer's recomputation"
    )
    assert problem.fix == (
        f"leave rollout.dtype=auto to generate in the training compute dtype, or set "
        f"actor.fsdp.param_dtype={rollout}; rollout.allow_dtype_mismatch=true runs them apart"
    )


@pytest.mark.parametrize(("overrides", "param", "compute"), MISMATCHES)
def test_the_opt_in_runs_a_mismatch_with_one_warning(
    validate_warnings, overrides: list[str], param: str, compute: str
) -> None:
    (message,) = validate_warnings([*overrides, "rollout.allow_dtype_mismatch=true"])
    rollout = overrides[0].split("=")[1]
    assert message.startswith(f"rollout.dtype={rollout} is not the training compute dtype")
    assert "importance weights" in message and "\n" not in message
    assert message.endswith("(accepted: rollout.allow_dtype_mismatch=true)")


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # auto: the training compute dtype (float32 masters computing and generating in bf16 on GPU)
        ["rollout.dtype=bf16", "trainer.device=cuda"],
        ["rollout.dtype=float32", "trainer.device=cpu"],
        ["rollout.dtype=float16", "actor.fsdp.param_dtype=fp16"],
        ["rollout.dtype=bfloat16"],  # trainer.device=auto: decided at start, once the device is known
        ["rollout.dtype=auto", "actor.fsdp.param_dtype=float32", "actor.fsdp.master_dtype=float32"],
    ],
)
def test_a_rollout_in_the_training_compute_dtype_is_silent(validate_warnings, overrides: list[str]) -> None:
    assert validate_warnings(overrides) == []


@pytest.mark.parametrize(("on_gpu", "refused"), [(False, True), (True, False)])
def test_device_auto_is_decided_at_start(on_gpu: bool, refused: bool) -> None:
    from hybridflow.config import check_start

    cfg = load_config(overrides=["rollout.dtype=bfloat16"])  # auto: bfloat16 on GPU, float32 on CPU
    if not refused:
        check_start(cfg, {}, on_gpu)
        return
    with pytest.raises(ConfigError) as info:
        check_start(cfg, {}, on_gpu)
    assert str(info.value).startswith(
        "rollout.dtype: bfloat16 is not the training compute dtype (actor.fsdp.param_dtype=auto: float32 on "
        "CPU)"
    )
    assert "(trainer.device=auto computes on the CPU here)" in str(info.value)
    opted_in = load_config(overrides=["rollout.dtype=bfloat16", "rollout.allow_dtype_mismatch=true"])
    check_start(opted_in, {}, on_gpu)  # accepted, with the warning


def test_the_opt_in_is_documented() -> None:
    help_text = schema_index()[0]["rollout.allow_dtype_mismatch"].help
    assert "rollout.dtype" in help_text and "training compute dtype" in help_text
    assert "`rollout.allow_dtype_mismatch`" in DOC.read_text()


def test_rollout_dtype_help_says_auto_is_the_training_compute_dtype() -> None:
    help_text = schema_index()[0]["rollout.dtype"].help
    assert "auto (the training compute dtype, actor.fsdp.param_dtype" in help_text
