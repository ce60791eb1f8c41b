"""The generated parts of docs/config.md: the field reference and the verl alias table.

Regenerate after changing the schema or the alias table::

    python -m hybridflow.config.reference docs/config.md

A test fails while the document and the code disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from hybridflow.config.aliases import (
    SHORTHANDS,
    VALUE_NAMES,
    VERL_ALIASES,
    VERL_IGNORED,
    VERL_UNSUPPORTED,
    VERL_VALUE_MAPS,
    VERL_VALUE_NOTES,
)
from hybridflow.config.choices import CHOICES
from hybridflow.config.schema import schema_index
from hybridflow.config.spellings import BY_NAME, POINTERS

BEGIN = "<!-- BEGIN GENERATED: {name} (python -m hybridflow.config.reference docs/config.md) -->"
END = "<!-- END GENERATED: {name} -->"


def _literal(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return f"`{text}`"


def fields_markdown() -> str:
    """One table per section: key, default, help (and the valid values of enumerated keys)."""
    leaves, sections = schema_index()
    out: list[str] = []
    for name, help_text in sections.items():
        rows = [spec for path, spec in leaves.items() if path.rsplit(".", 1)[0] == name]
        if not rows:
            continue
        out += [f"### `{name}`", "", help_text, "", "| key | default | meaning |", "|---|---|---|"]
        for spec in rows:
            choices = (
                f" Valid: {', '.join(f'`{c}`' for c in CHOICES[spec.path])}." if spec.path in CHOICES else ""
            )
            out.append(f"| `{spec.path}` | {_literal(spec.default)} | {spec.help}{choices} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def aliases_markdown() -> str:
    """The verl keys we accept (with value translations), judge by value, or refuse with a fix."""
    out = ["| verl key | hybridflow key |", "|---|---|"]
    for verl_key, ours in VERL_ALIASES.items():
        values = VERL_VALUE_MAPS.get(verl_key)
        note = " (" + ", ".join(f"`{a}` -> `{b}`" for a, b in values.items()) + ")" if values else ""
        instead = VERL_VALUE_NOTES.get(verl_key)
        if instead and values:
            replaced = [str(v) for v, to in values.items() if v != to]
            names = " / ".join(VALUE_NAMES.get(v, v) for v in replaced)
            runs = " / ".join(dict.fromkeys(str(values[v]) for v in replaced))
            note += ": " + instead.format(key=verl_key, value=" / ".join(replaced), name=names, ours=runs)
        out.append(f"| `{verl_key}` | `{ours}`{note} |")
    out += [
        "",
        "Keys without a field here, judged by value: a value that asks for what hybridflow does anyway is",
        "accepted with a one-line warning saying how it behaves; any other value is refused with the fix.",
        "",
        "| verl key | accepted | how hybridflow behaves | any other value is refused: why; fix |",
        "|---|---|---|---|",
    ]
    for key, entry in VERL_IGNORED.items():
        refused = "-"
        if entry.accepts is not None:
            because = f"{entry.refusal}; " if entry.refusal else ""
            refused = f"{because}fix: {entry.fix_for(key)}"
        out.append(f"| `{key}` | `{entry.accepted_text()}` | {entry.notice} | {refused} |")
    out += ["", "Refused, with this fix:", "", "| verl key | fix |", "|---|---|"]
    out += [f"| `{key}` | {fix} |" for key, fix in VERL_UNSUPPORTED.items()]
    return "\n".join(out) + "\n" + spellings_markdown()


def spellings_markdown() -> str:
    """The short spellings we map, the keys judged by their last name, and the keys refused with a pointer."""
    out = ["", "Short spellings (the write-ups', verl's without its prefix), mapped:", ""]
    out += ["| spelling | hybridflow key |", "|---|---|"]
    out += [f"| `{key}` | `{ours}` |" for key, ours in SHORTHANDS.items()]
    out += [
        "",
        "Keys judged by their last name wherever they appear (`rollout.quantization`, "
        "`actor_rollout_ref.actor.megatron.expert_model_parallel_size`, ...), unless they are hybridflow's own "
        "or lie inside a free-form mapping such as `model.override_config`:",
        "",
        "| last name | accepted | how hybridflow behaves | refused values: why; fix |",
        "|---|---|---|---|",
    ]
    for name, entry in BY_NAME.items():
        refused = "<br>".join(
            f"{r.values}: {r.reason}; fix: {r.fix.format(key=f'*.{name}', value='X', role='ROLE')}"
            for r in entry.refusals
        )
        out.append(f"| `{name}` | `{entry.accepted_text()}` | {entry.notice} | {refused} |")
    out += [
        "",
        "Keys that are nobody's, refused with the key to write:",
        "",
        "| key | why | fix |",
        "|---|---|---|",
    ]
    out += [
        f"| `*.{name}` (e.g. `algorithm.{name}`) | {why} | {fix.format(value='N')} |"
        for name, (fix, why) in POINTERS.items()
    ]
    return "\n".join(out) + "\n"


GENERATORS = {"fields": fields_markdown, "aliases": aliases_markdown}


def render_into(document: str) -> str:
    """``document`` with every generated block replaced by the current output of its generator."""
    for name, generate in GENERATORS.items():
        begin, end = BEGIN.format(name=name), END.format(name=name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
        if not pattern.search(document):
            raise ValueError(f"the document has no generated block {name!r}; add the lines:\n{begin}\n{end}")
        document = pattern.sub(lambda _m, b=begin, e=end, g=generate: f"{b}\n{g()}{e}", document)
    return document


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
    target.write_text(render_into(target.read_text()))
