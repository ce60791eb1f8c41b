"""The cheap checks of each command, run before it imports torch or transformers or loads a model.

The config (keys, values, the checks across fields), the files it reads (data, reward function, tool config;
each exists and is readable), the directories it writes (nothing is created here) and the model directories
(each exists and holds config.json) are judged from the file system alone (and the code sandbox's isolation
from one sandboxed ``python -c pass`` when a run uses ``code_interpreter``), so a mistake in any of them is one
``error:`` line within a second or two rather than after the imports and a model load. The commands keep their
own checks; these only come first. Only what a run will read is checked: the critic's model with a critic, the
reward model when it is on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from hybridflow.cli.output import check_output_dir, check_output_file
from hybridflow.config import Config, load_config
from hybridflow.config.loader import check_keys
from hybridflow.utils.errors import MissingFileError, UserError
from hybridflow.utils.host import check_one_process
from hybridflow.utils.paths import TOKENIZER_FILES, check_local_dir, check_readable_file, check_writable_dir

DATA_SUFFIXES = (".parquet", ".jsonl")
RUN_DIR = "the run directory (trainer.default_local_dir)"


def check_config_paths(cfg: Config) -> None:
    """The model directories, the files and the output directories a run of ``cfg`` reads and writes."""
    if cfg.model.path is not None:
        check_local_dir(cfg.model.path, what="model.path")
    if cfg.model.tokenizer_path is not None:
        check_local_dir(cfg.model.tokenizer_path, TOKENIZER_FILES, what="model.tokenizer_path")
    if cfg.use_critic and cfg.critic.model.path is not None:
        check_local_dir(cfg.critic.model.path, what="critic.model.path")
    if cfg.reward.model.enable and cfg.reward.model.path is not None:
        check_local_dir(cfg.reward.model.path, what="reward.model.path")
    for key in ("train_files", "val_files"):
        for file in getattr(cfg.data, key) or []:
            check_readable_file(file, f"data.{key}", DATA_SUFFIXES)
    if cfg.reward.custom_function.path:
        from hybridflow.rewards.loader import reward_file  # light: no torch

        file = reward_file(cfg.reward.custom_function.path)
        if file is not None:
            check_readable_file(file, "reward.custom_function.path")
    mt = cfg.rollout.multi_turn
    if mt.tool_config_path:
        check_readable_file(mt.tool_config_path, "rollout.multi_turn.tool_config_path")
    if mt.enable and "code_interpreter" in mt.tools and not mt.sandbox.allow_unisolated:
        from hybridflow.tools.sandbox import require_isolation  # light: the standard library and a probe

        require_isolation()
    t = cfg.trainer
    if (
        t.resume_mode == "resume_path"
        and t.resume_from_path
        and not Path(t.resume_from_path).expanduser().exists()
    ):
        raise MissingFileError(
            f"trainer.resume_from_path: {t.resume_from_path}: no such checkpoint directory"
        )
    for key in ("rollout_data_dir", "validation_data_dir"):
        if getattr(t, key):
            check_writable_dir(getattr(t, key), f"trainer.{key}")


def _file_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    from hybridflow.cli.config_cmd import split_file_and_overrides

    return split_file_and_overrides(args.args)


def _run_config(args: argparse.Namespace, demo_without_model: bool) -> Config | None:
    """The command's config with its paths checked, or None for the built-in demo (its keys checked)."""
    from hybridflow.cli.config_cmd import names_a_model

    path, overrides = _file_and_overrides(args)
    if demo_without_model and path is None and not names_a_model(overrides):
        check_keys(overrides)  # laid over the demo's own settings later, which decide the rest
        return None
    cfg = load_config(path, overrides)
    check_config_paths(cfg)
    return cfg


def check_rl(args: argparse.Namespace) -> None:
    """train, dpo and kto: the config and its paths, and the run directory; the demo: its overrides' keys."""
    cfg = _run_config(args, demo_without_model=args.command in ("train", "dpo"))
    if cfg is not None:
        check_writable_dir(cfg.trainer.run_dir(), RUN_DIR)


def check_sft(args: argparse.Namespace) -> None:
    """sft: the config and its paths, the run directory and the output model directory."""
    cfg = _run_config(args, demo_without_model=False)
    assert cfg is not None
    check_writable_dir(cfg.trainer.run_dir(), RUN_DIR)
    out = Path(args.out or Path(cfg.trainer.run_dir()) / "sft_model").expanduser()
    check_output_dir(out, args.overwrite)
    check_writable_dir(out, "--out")


def check_eval(args: argparse.Namespace) -> None:
    """eval: one process, the config file (with its model and validation files) or the checkpoint folder, and
    --out."""
    check_one_process("eval")
    first, overrides = args.args[0], args.args[1:]
    path = Path(first).expanduser()
    if "=" in first and not path.exists():
        raise UserError("the first argument of eval is a config file or a checkpoint folder, not an override")
    if not path.exists():
        raise MissingFileError(f"{path} does not exist: pass a YAML config or a checkpoint folder")
    if path.is_file():
        cfg = load_config(str(path), overrides)
        check_config_paths(cfg)
        out = Path(args.out or Path(cfg.trainer.run_dir()) / "eval.jsonl").expanduser()
    else:  # a checkpoint: its run's config.yaml is found beside it when the command runs
        check_keys(overrides)
        out = Path(args.out).expanduser() if args.out else None
    if out is not None:
        check_output_file(out, args.overwrite)
        check_writable_dir(out.parent, "the directory of --out")


def check_generate(args: argparse.Namespace) -> None:
    """generate: the model and tokenizer directories, the prompts file and --out."""
    check_local_dir(args.model, what="--model")
    if args.tokenizer is not None:
        check_local_dir(args.tokenizer, TOKENIZER_FILES, what="--tokenizer")
    check_readable_file(args.prompts, "--prompts")
    out = Path(args.out).expanduser()
    check_output_file(out, args.overwrite)
    check_writable_dir(out.parent, "the directory of --out")


def check_export(args: argparse.Namespace) -> None:
    """export: the checkpoint exists and --out is free (or --overwrite)."""
    ckpt = Path(args.checkpoint).expanduser()
    if not ckpt.exists():
        raise MissingFileError(f"checkpoint {ckpt} does not exist")
    check_output_dir(Path(args.out).expanduser(), args.overwrite)


CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "train": check_rl,
    "dpo": check_rl,
    "kto": check_rl,
    "sft": check_sft,
    "eval": check_eval,
    "generate": check_generate,
    "export": check_export,
}


def check_inputs(args: argparse.Namespace) -> None:
    """Run the cheap checks of ``args.command`` (none for a command without any); a ``UserError`` on the first
    problem."""
    check = CHECKS.get(getattr(args, "command", None) or "")
    if check is not None:
        check(args)
