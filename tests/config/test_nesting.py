"""A config nested thousands of levels deep (or holding itself) is a user error naming where it came from.

YAML files, dotted overrides, override values and the Python API's dict each reached a RecursionError (an
internal error) before these checks: PyYAML's parser, the loader's walk and ``copy.deepcopy`` recurse once
per level.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.api.notebook import Setup
from hybridflow.cli.main import main
from hybridflow.config import ConfigError, config_from_dict, load_config
from hybridflow.config.nesting import MAX_DEPTH, nesting_problem

DEEP = 10_000


def nested(depth: int, leaf: object = 1) -> dict:
    """``{"a": {"a": ... leaf}}`` with ``depth`` mappings, built without recursion."""
    top: dict = {}
    node = top
    for _ in range(depth - 1):
        node["a"] = {}
        node = node["a"]
    node["a"] = leaf
    return top


YAML_FILES = {
    "flow mappings": "model:\n  override_config: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n",
    "block mappings": "model:\n"
    + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(DEEP))
    + "  " * (DEEP + 1)
    + "1\n",
    "lists": "trainer:\n  logger: " + "[" * DEEP + "]" * DEEP + "\n",
    "150 levels (parsed, then refused)": "model:\n  override_config: "
    + "{a: " * 150
    + "1"
    + "}" * 150
    + "\n",
    "an alias to its own anchor": "model:\n  override_config: &loop\n    a: *loop\n",
}


@pytest.mark.parametrize("text", YAML_FILES.values(), ids=YAML_FILES.keys())
def test_a_yaml_file_nested_too_deep_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: (nests more than {MAX_DEPTH} levels|holds itself)"):
        load_config(str(path))
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "internal error" not in err


def test_overrides_nested_too_deep_exit_2_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    value = "model.override_config=" + "{a: " * DEEP + "1" + "}" * DEEP
    with pytest.raises(ConfigError, match=rf"^model.override_config: nests more than {MAX_DEPTH} levels"):
        load_config(None, [value])
    dotted = "model.override_config." + ".".join(["a"] * DEEP) + "=1"  # a free-form mapping, built that deep
    with pytest.raises(ConfigError, match=r"^model.override_config.a.a.*\(10002 parts\): has more than 100"):
        load_config(None, [dotted])
    for override in (value, dotted):
        assert main(["config", "show", override]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: model.override_config") and err.count("\n") == 1, err[:300]


def test_the_python_apis_dict_nested_too_deep_or_holding_itself_is_refused() -> None:
    deep = {"model": {"override_config": nested(DEEP)}}
    with pytest.raises(ConfigError, match=rf"^the config mapping: nests more than {MAX_DEPTH} levels"):
        config_from_dict(deep)
    with pytest.raises(ConfigError, match=rf"^config: nests more than {MAX_DEPTH} levels"):
        Setup.of({}, deep, None)  # RLTrainer(config=...) copies the dict first
    loop: dict = {"model": {"override_config": {}}}
    loop["model"]["override_config"]["a"] = loop
    with pytest.raises(ConfigError, match=r"^config: holds itself"):
        Setup.of({}, loop, None)
    dotted = {"model.override_config." + ".".join(["a"] * DEEP): 1}  # dotted keys are read as paths
    with pytest.raises(ConfigError, match=r"\(10002 parts\): has more than 100 dotted parts"):
        config_from_dict(dotted)


def test_real_nesting_is_accepted_up_to_the_bound() -> None:
    assert nesting_problem(nested(MAX_DEPTH)) is None
    assert nesting_problem(nested(MAX_DEPTH + 1)) is not None
    shared = [{"x": [1, 2]}] * 3  # a YAML alias used twice is no loop
    assert nesting_problem({"a": shared, "b": [shared, shared]}) is None
    cfg = config_from_dict(
        {"model": {"override_config": {"rope_scaling": {"type": "linear", "factor": 2.0}}}}
    )
    assert cfg.model.override_config == {"rope_scaling": {"type": "linear", "factor": 2.0}}
