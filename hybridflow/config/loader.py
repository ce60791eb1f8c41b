"""Build a Config from YAML files, mappings and Hydra-style ``key=value`` overrides.

Everything goes through one path: the input is flattened into (dotted key, value) items, verl aliases
are mapped to our fields, the items are laid over the defaults, each value is checked against its
field's type, and the result is validated. All problems of one stage are reported together.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config import aliases, spellings
from hybridflow.config.errors import ConfigError, Problem
from hybridflow.config.nesting import FIX as NESTING_FIX
from hybridflow.config.nesting import MAX_DEPTH, TOO_DEEP, check_nesting
from hybridflow.config.schema import Config, schema_index
from hybridflow.config.suggest import all_keys, unknown_key
from hybridflow.config.validate import validate_config
from hybridflow.utils.errors import MissingFileError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loading, plus the exponent floats PyYAML reads as str (``1e-6``, ``2.0e3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_value(text: str, key: str = "the override value") -> Any:
    """Parse one override value with YAML scalar rules: ints, floats (1e-6 too), bools, null, [lists].

    A value nested too deep for a config (``nesting``) is a ``ConfigError`` naming ``key``.
    """
    if text.strip() == "":
        return None
    try:
        value = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError:
        return text  # an unparseable value is a plain string; the field's type check judges it
    except RecursionError:  # PyYAML's parser recurses once per level
        raise ConfigError([Problem(key, TOO_DEEP, NESTING_FIX)]) from None
    check_nesting(value, key)
    return value


@dataclass(frozen=True)
class _Item:
    path: str  # our dotted path (after alias resolution)
    value: Any
    given_as: str | None  # the verl key the user wrote, when it was an alias
    replaced: bool = False  # its value was replaced (rollout.name=vllm), which a warning line has said


def _dict_leaf_prefix(path: str) -> str | None:
    """The dict-typed field that ``path`` is (or lies inside), e.g. model.override_config."""
    leaves, _ = schema_index()
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        spec = leaves.get(".".join(parts[:end]))
        if spec is not None:
            return spec.path if typing.get_origin(spec.type) is dict else None
    return None


def _flatten(path: str, value: Any, out: list[_Item], problems: list[Problem]) -> None:
    """Turn a (possibly nested) mapping under ``path`` into items, resolving verl aliases on the way."""
    if path.count(".") >= MAX_DEPTH:  # a dotted key into a free-form mapping would build it that deep
        where = f"{path[:60]}... ({path.count('.') + 1} parts)"
        problems.append(Problem(where, f"has more than {MAX_DEPTH} dotted parts", NESTING_FIX))
        return
    ours, verl_key = aliases.resolve_alias(path) if path else ("", None)
    leaves, sections = schema_index()
    if value is None and ours in sections:
        return  # an empty YAML section ('trainer:' with every key commented out) changes nothing
    free_form = ours in leaves or _dict_leaf_prefix(ours) is not None
    if isinstance(value, Mapping) and (not path or ours in sections or not free_form):
        if not value and path and not any(k.startswith(path + ".") for k in all_keys()):
            problems.append(unknown_key(path))  # an empty mapping under a key that leads nowhere
        for key, sub in value.items():
            _flatten(f"{path}.{key}" if path else str(key), sub, out, problems)
        return
    if verl_key is not None:
        translated = _translated(verl_key, value)
        noted = translated != value and aliases.value_note(verl_key, value) is not None
        out.append(_Item(ours, translated, path, replaced=noted))
        return
    ignored = aliases.ignored_key(path)
    if ignored is not None:
        _judge(path, ignored[0], ignored[1], value, problems, "verl key")
        return
    fix = aliases.unsupported_fix(path)
    if fix is not None:
        problems.append(Problem(path, "this verl key is not supported", fix))
        return
    if ours not in leaves and _dict_leaf_prefix(ours) is None and _spelling(path, value, problems):
        return
    out.append(_Item(ours, _translated(path, value), None))


def _judge(
    path: str, key: str, entry: aliases.IgnoredKey, value: Any, problems: list[Problem], kind: str
) -> None:
    """A key without a field here: its value accepted with a one-time notice, or refused with the fix."""
    if entry.accepts_value(value):
        aliases.notice_once(
            path, f"{kind} '{path}' ignored: {entry.notice} (value {value!r})", logging.WARNING
        )
    else:
        problems.append(Problem(path, entry.refused_message(value), entry.fix_for(key, value)))


def _spelling(path: str, value: Any, problems: list[Problem]) -> bool:
    """Judge a key that is none of ours by its name (FP8, expert parallelism, ...); whether it was one."""
    found = spellings.pointer(path, value)
    if found is not None:
        why, fix = found
        problems.append(Problem(path, f"is not a key here: {why}", fix))
        return True
    named = spellings.judged_by_name(path)
    if named is None:
        return False
    _judge(path, path, named[1], value, problems, "key")
    return True


def _translated(key: str, value: Any) -> Any:
    """The value ``key`` (as written: a verl key or ours) means here; a replaced value (rollout.engine=vllm)
    says once, in one warning line, what runs in its place."""
    translated = aliases.translate_value(key, value)
    if translated != value:
        note = aliases.value_note(key, value)
        if note is not None:
            aliases.notice_once(f"{key}={value}", note, logging.WARNING)
    return translated


def _apply(tree: dict[str, Any], item: _Item, problems: list[Problem]) -> None:
    """Set one item in the nested dict of values, or record why it cannot be set."""
    leaves, sections = schema_index()
    dict_leaf = _dict_leaf_prefix(item.path)
    if item.path in sections:
        problems.append(
            Problem(
                item.path,
                f"is a section, not a value (got {item.value!r})",
                f"set one of its keys, e.g. {_first_key(item.path)}=...",
                item.given_as,
            )
        )
        return
    if item.path not in leaves and dict_leaf is None:
        problems.append(unknown_key(item.given_as or item.path))
        return
    node = tree
    parts = item.path.split(".")
    for i, part in enumerate(parts[:-1]):
        inside_dict = dict_leaf is not None and len(".".join(parts[: i + 1])) >= len(dict_leaf)
        if inside_dict and not isinstance(node.get(part), dict):
            node[part] = {}  # a new sub-mapping inside a free-form dict field
        node = node[part]
    node[parts[-1]] = item.value


def _first_key(section: str) -> str:
    leaves, _ = schema_index()
    return next(p for p in leaves if p.startswith(section + "."))


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(names) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict:
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where lossless (int -> float, x -> [x])."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is list:
        if value is None:
            raise _Mismatch
        items = value if isinstance(value, (list, tuple)) else [value]  # 'logger=console' means [console]
        return [_coerce(v, typing.get_args(tp)[0]) for v in items]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML reads a bare off / on as false / true: router_replay=off
            return "on" if value else "off"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # experiment_name=123 is the string '123'
    raise _Mismatch


def _build(
    cls: type, values: Mapping[str, Any], prefix: str, given: dict[str, str], problems: list[Problem]
) -> Any:
    """Instantiate dataclass ``cls`` from nested ``values``, checking every leaf's type."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path, tp, value = f"{prefix}{f.name}", hints[f.name], values[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, path + ".", given, problems)
            continue
        try:
            kwargs[f.name] = _coerce(value, tp)
        except _Mismatch:
            spec = schema_index()[0][path]
            example = (
                yaml.safe_dump(spec.default, default_flow_style=True).strip().removesuffix("...").strip()
            )
            problems.append(
                Problem(
                    path,
                    f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})",
                    f"e.g. {path}={example} (the default)",
                    given.get(path),
                )
            )
    return cls(**kwargs)


def _resolve(
    items: Iterable[_Item], problems: list[Problem], defer: Collection[str] = (), validate: bool = True
) -> Config:
    """Lay the items over the defaults, type-check, validate; raise ConfigError listing every problem.

    ``defer``: fields whose validation problems are left out (fields a later step chooses, such as the layout
    keys the automatic layout plans, which are validated once chosen). ``validate=False`` stops after the
    type check: the keys and values on their own, nothing across fields.
    """
    tree = Config().to_dict()
    given: dict[str, str] = {}
    written: dict[str, str] = {}  # every field set -> the key written for it (the last writer's)
    for item in items:
        _apply(tree, item, problems)
        given.pop(item.path, None)  # the last writer of a field decides how the user spelled it
        if item.given_as is not None:
            given[item.path] = item.given_as
        written[item.path] = item.given_as or item.path
    if problems:
        raise ConfigError(problems)
    cfg = _build(Config, tree, "", given, problems)
    if problems:
        raise ConfigError(problems)
    if not validate:
        return cfg
    deferred = {aliases.resolve_alias(path)[0] for path in defer}
    problems.extend(
        dataclasses.replace(p, given_as=p.given_as or _spelled(p.path, written))
        for p in validate_config(cfg)
        if aliases.resolve_alias(p.path)[0] not in deferred
    )
    if problems:
        raise ConfigError(problems)
    return cfg


def _spelled(path: str, written: dict[str, str]) -> str | None:
    """How the user spelled the field a problem names, when it differs from the name: a verl key, or for a
    problem named by a field's long spelling (``actor.tensor_parallel_size``), the key written for its field
    (``actor.parallel.tp``)."""
    spelled = written.get(path) or written.get(aliases.resolve_alias(path)[0])
    return None if spelled == path else spelled


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    """Split ``key=value`` overrides (Hydra's ``+key`` and ``++key`` forms too) into (key, value)."""
    pairs = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key or key.startswith("~"):
            raise ConfigError(
                [
                    Problem(
                        key.lstrip("~") or text,
                        f"override {text!r} is not of the form key=value",
                        "write e.g. rollout.n=8",
                    )
                ]
            )
        pairs.append((key, parse_value(raw, key)))
    return pairs


def _read_yaml(path: str | Path) -> Mapping[str, Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise MissingFileError(f"config file '{path}' not found (looked in {file.resolve().parent})")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            [Problem(str(path), f"line {line} is not valid UTF-8 (byte {exc.start})", "re-save it as UTF-8")]
        ) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            [Problem(str(path), f"is not valid YAML ({where}{what})", "fix the YAML syntax there")]
        ) from None
    except RecursionError:  # PyYAML's parser recurses once per level
        raise ConfigError([Problem(str(path), TOO_DEEP, NESTING_FIX)]) from None
    check_nesting(data, str(path))
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            [
                Problem(
                    str(path),
                    f"must hold a mapping of sections, got {type(data).__name__}",
                    "start the file with e.g. 'rollout:'",
                )
            ]
        )
    return data


def check_keys(overrides: list[str]) -> None:
    """Refuse what ``key=value`` overrides get wrong on their own: an unknown or refused key, a value of the
    wrong type. Nothing across fields is judged: the config they are laid over (the demo's) settles that."""
    problems: list[Problem] = []
    items: list[_Item] = []
    for key, value in parse_overrides(overrides):
        _flatten(key, value, items, problems)
    _resolve(items, problems, validate=False)


def config_from_dict(
    data: Mapping[str, Any], overrides: list[str] | None = None, defer: Collection[str] = ()
) -> Config:
    """Build and validate a Config from a nested mapping (verl keys accepted) and optional overrides
    (``defer``: fields validated later, by whoever chooses them; ``_resolve``)."""
    check_nesting(data, "the config mapping")
    problems: list[Problem] = []
    items: list[_Item] = []
    _flatten("", data, items, problems)
    for key, value in parse_overrides(overrides or []):
        _flatten(key, value, items, problems)
    # one line for the keys read as ours; a key whose value was replaced has had its own line
    aliases.notice_mappings(
        [(i.given_as, i.path) for i in items if i.given_as is not None and not i.replaced]
    )
    return _resolve(items, problems, defer)


def load_config(
    path: str | None = None, overrides: list[str] | None = None, defer: Collection[str] = ()
) -> Config:
    """Load a Config: the defaults, then the YAML file ``path`` (if any), then ``key=value`` overrides
    (``defer``: fields validated later, by whoever chooses them; ``_resolve``)."""
    data = _read_yaml(path) if path is not None else {}
    return config_from_dict(data, overrides, defer)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML (it loads back with load_config); parent directories are made."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(to_yaml(cfg))
    return file


def to_yaml(cfg: Config) -> str:
    """The resolved config as a YAML document, sections in schema order."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
