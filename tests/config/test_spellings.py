"""Issue 38: every spelling of verl and the HybridFlow write-ups either maps onto a hybridflow key or is refused
with the key to use (or "not supported yet", with its issue), as an override and as nested YAML."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.spelling_cases import (
    MAPPED,
    NO_OPS,
    REFUSED,
    SNIPPETS,
    Noted,
    Refused,
    Snippet,
    Taken,
    leaf_keys,
    without,
)

from hybridflow.config import Config, ConfigError, Problem, config_from_dict, load_config
from hybridflow.config import aliases as aliases_module
from hybridflow.config.schema_base import get_path


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aliases_module, "_noticed", set())


def nested(override: str) -> dict[str, Any]:
    """``a.b.c=v`` as the nested mapping a YAML file writes (``{a: {b: {c: v}}}``)."""
    key, _, raw = override.partition("=")
    value: Any = yaml.safe_load(raw)
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def merged(overrides: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for override in overrides:
        node, tree = out, nested(override)
        while True:
            ((key, sub),) = tree.items()
            if not isinstance(sub, dict) or key not in node:
                node[key] = sub
                break
            node, tree = node[key], sub
    return out


def load(overrides: list[str], how: str, tmp_path: Path) -> Config:
    """The config of ``overrides`` given as overrides, or written as one nested YAML file."""
    if how == "overrides":
        return load_config(overrides=overrides)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(merged(overrides)))
    return load_config(str(path))


HOW = ["overrides", "yaml"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(("spelling", "extra", "ours", "value"), MAPPED, ids=[m[0] for m in MAPPED])
def test_a_spelling_maps_onto_our_key(
    spelling: str, extra: list[str], ours: str, value: Any, how: str, tmp_path: Path
) -> None:
    cfg = load([*extra, spelling], how, tmp_path)
    assert get_path(cfg, ours) == value
    same = load_config(overrides=[*extra, f"{ours}={yaml.safe_dump(value).splitlines()[0]}"])
    assert cfg == same  # and nothing else changed


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("spelling", NO_OPS)
def test_a_value_meaning_off_is_a_no_op_with_one_notice(
    spelling: str, how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("hybridflow"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="hybridflow.config.aliases"):
        assert load([spelling], how, tmp_path) == Config()
    key = spelling.split("=")[0]
    (message,) = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert message.startswith(f"key '{key}' ignored: ")


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(("spelling", "words", "fix"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_spelling_we_do_not_take_is_refused_naming_the_key_to_use(
    spelling: str, words: str, fix: str, how: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        load([spelling], how, tmp_path)
    (problem,) = info.value.problems
    assert problem.path == spelling.split("=")[0]
    assert words in problem.message and fix in problem.fix
    assert "unknown config key" not in str(problem)


def test_the_write_ups_dtype_alignment_runs_as_written(tmp_path: Path) -> None:
    # the write-ups' "correct" alignment: bf16 compute, fp32 reductions and buffers, a bf16 rollout on GPU
    path = tmp_path / "run.yaml"
    path.write_text(
        "actor:\n  fsdp_config:\n    mixed_precision:\n      param_dtype: bf16\n      reduce_dtype: fp32\n"
        "      buffer_dtype: fp32\nrollout:\n  dtype: bfloat16\n"
    )
    cfg = load_config(str(path))
    assert (cfg.actor.fsdp.param_dtype, cfg.actor.fsdp.reduce_dtype, cfg.rollout.dtype) == (
        "bf16",
        "fp32",
        "bfloat16",
    )


def test_a_key_inside_a_free_form_mapping_is_the_users() -> None:
    # quantization_config / quantization inside override_config belong to the model's HF config
    cfg = load_config(overrides=["model.override_config.quantization=fp8"])
    assert cfg.model.override_config == {"quantization": "fp8"}


def test_a_dotted_unknown_key_is_never_offered_a_section() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["algorithm.gama=1"])
    message = str(info.value)
    assert "did you mean 'algorithm.gamma'" in message and "'algorithm'" not in message


def test_the_readme_counts_the_aliases_and_short_spellings() -> None:
    from hybridflow.config.aliases import SHORTHANDS, VERL_ALIASES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"{len(VERL_ALIASES)} verl key aliases and {len(SHORTHANDS)} short spellings" in readme


def load_snippet(snippet: Snippet, given: dict[str, Any] | list[str]) -> Config:
    """The config of a snippet (or part of it) in its context: a dict as a YAML file is read, or overrides."""
    if isinstance(given, dict):
        return config_from_dict(given, snippet.context)
    return load_config(overrides=[*snippet.context, *given])


def problems_of(load: Any) -> tuple[Config | None, list[Problem]]:
    try:
        return load(), []
    except ConfigError as exc:
        return None, exc.problems


def as_override(key: str, value: Any) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_every_key_of_a_write_ups_snippet_is_taken_or_refused_naming_the_key_to_use(
    snippet: Snippet, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sorted(leaf_keys(snippet.given)) == sorted(snippet.keys)  # the table says what becomes of each key
    monkeypatch.setattr(logging.getLogger("hybridflow"), "propagate", True)
    refused = {key for key, fate in snippet.keys.items() if isinstance(fate, Refused)}
    with caplog.at_level(logging.INFO, logger="hybridflow.config.aliases"):
        _, problems = problems_of(lambda: load_snippet(snippet, snippet.given))
        assert not [p for p in problems if "unknown config key" in p.message]
        at_keys = {p.path: p for p in problems if p.path in refused}
        assert sorted(at_keys) == sorted(refused)
        for key in refused:
            assert snippet.keys[key].fix in at_keys[key].fix, at_keys[key]
        cfg, problems = problems_of(lambda: load_snippet(snippet, without(snippet.given, refused)))
    logged = [r.getMessage() for r in caplog.records]
    taken = {key: fate for key, fate in snippet.keys.items() if isinstance(fate, Taken)}
    for key, fate in taken.items():  # a verl key or short spelling is in the one mapping line (or its own)
        said = [m for m in logged if f"'{key}' -> '{fate.ours}'" in m or m.startswith(f"{key}=")]
        assert key == fate.ours or said, key
    for key, fate in snippet.keys.items():
        if isinstance(fate, Noted):
            assert any(m.startswith(f"key '{key}' ignored: ") and fate.words in m for m in logged), key
    ours = [*snippet.context, *(as_override(f.ours, f.value) for f in taken.values())]
    same_cfg, same_problems = problems_of(lambda: load_config(overrides=ours))
    # the snippet means what its translation into our keys means: the same config, or the same refusal
    assert cfg == same_cfg
    assert [(p.path, p.message, p.fix) for p in problems] == [
        (p.path, p.message, p.fix) for p in same_problems
    ]
    assert [(p.path, any(w in p.fix for _, w in snippet.verdict)) for p in problems] == [
        (path, True) for path, _ in snippet.verdict
    ]
