"""A ``verifiers`` environment as the harness (``rollout.harness.verifiers_env``): each episode is one episode
of the environment, its harness talking to the run's endpoint through verifiers' interception server, its
rubric (the task's ``@vf.reward`` and ``@vf.metric`` functions) giving the reward and the metrics.

The prompts come from hybridflow's dataset (``data.*``), not from the environment's own taskset: a row is
made into one of the environment's tasks (its ``Task`` class and data type), ``prompt`` from the row's
``raw_prompt``, every field of the row's ``extra_info`` that the data type declares, and ``answer`` from the
row's ``ground_truth`` when the type declares an ``answer`` the ``extra_info`` does not give. ``verifiers`` is
an optional package: nothing here imports it until a run asks for an environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hybridflow.utils.errors import UserError
from hybridflow.utils.pyfile import exec_file

KEY = "rollout.harness.verifiers_env"
CONFIG_KEY = "rollout.harness.verifiers_config"
# verifiers reads the endpoint's key from an environment variable; its subprocess runtime drops every
# variable whose name holds API_KEY, so the harness programs it launches never see the run's token.
TOKEN_VAR = "HYBRIDFLOW_API_KEY"


def _import_env_file(path: str) -> str:
    """Import the environment defined in the .py file ``path``; its module name (what verifiers imports)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UserError(f"{KEY}={path!r}: no such file; name a .py file or an installed environment")
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() != file:
            raise UserError(
                f"{KEY}={path!r}: a module named {name!r} is already loaded from elsewhere; rename the file"
            )
        return name
    exec_file(file, name, f"{KEY}={path!r}")  # verifiers finds the environment by importing its name
    return name


def _env_config(vf: Any, env_id: str, config: dict[str, Any]) -> Any:
    """The environment's validated config: ``config`` on the taskset ``env_id``, every agent seat on the
    local ``subprocess`` runtime unless ``config`` gives it one (verifiers' default is a remote sandbox)."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    taskset = dict(raw.get("taskset") or {})
    if taskset.get("id", env_id) != env_id:
        raise UserError(
            f"{CONFIG_KEY}.taskset.id={taskset['id']!r} differs from {KEY}; name the environment once, in "
            f"{KEY}"
        )
    raw["taskset"] = {**taskset, "id": env_id}
    try:
        cls = vf.env_config_type(env_id, raw.get("id") or "")
        for name, field in cls.model_fields.items():
            if isinstance(field.default, vf.AgentConfig) and "runtime" not in (raw.get(name) or {}):
                raw[name] = {**(raw.get(name) or {}), "runtime": {"type": "subprocess"}}
        resolved = vf.resolve_env_config(raw)
    except (ModuleNotFoundError, TypeError, AttributeError) as exc:
        raise UserError(
            f"{KEY}={env_id!r} is not a verifiers environment ({exc}); install its package or name a .py "
            "file that defines one (a Taskset subclass in __all__)"
        ) from exc
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise UserError(f"{CONFIG_KEY}: the environment refused it: {exc}") from exc
    # a retried attempt would talk to the same endpoint episode: its abandoned tokens would train too
    retries = {"retries": resolved.retries}
    retries |= {
        f"{name}.retries": seat.retries for name, seat in resolved if isinstance(seat, vf.AgentConfig)
    }
    for path, retry in retries.items():
        if retry.max_retries:
            raise UserError(
                f"{CONFIG_KEY}.{path}.max_retries={retry.max_retries}: a retried attempt would train on the "
                f"tokens of the one it replaces; set it to 0 (rollout.harness.on_error decides a failure)"
            )
    return resolved


def _messages(prompt: Any) -> Any:
    """A row's ``raw_prompt`` as plain chat messages (or its text)."""
    if isinstance(prompt, str):
        return prompt
    return [dict(m) for m in prompt]


class VerifiersEnv:
    """One loaded environment; ``episode`` plays a dataset row as one of its episodes (see the module doc)."""

    def __init__(self, env: str, config: dict[str, Any]) -> None:
        if importlib.util.find_spec("verifiers") is None:
            raise UserError(
                f"{KEY} needs the verifiers package, which is not installed; fix: pip install verifiers"
            )
        import verifiers.v1 as vf

        self.vf = vf
        env_id = _import_env_file(env) if env.strip().endswith(".py") else env.strip()
        self.config = _env_config(vf, env_id, config)
        try:
            self.env = vf.load_environment(self.config)
        except (ModuleNotFoundError, TypeError, ValueError) as exc:
            raise UserError(f"{KEY}={env!r} failed to load ({type(exc).__name__}: {exc})") from exc
        self.task_cls = type(self.env.taskset).task_type()
        self.data_fields = set(self.task_cls.data_type().model_fields)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """The environment's serving resources (its interception server, shared tools) for one rollout."""
        async with self.env.serving():
            yield

    def task(self, row: dict[str, Any]) -> Any:
        """The environment's task for a dataset row."""
        data: dict[str, Any] = {"prompt": _messages(row["raw_prompt"])}
        extra = row.get("extra_info")
        if isinstance(extra, dict):
            data.update(
                {k: v for k, v in extra.items() if k in self.data_fields and k not in ("prompt", "idx")}
            )
        if "answer" in self.data_fields and "answer" not in data and row.get("ground_truth") is not None:
            data["answer"] = row["ground_truth"]
        task = self.task_cls(self.task_cls.data_type().model_validate(data), self.env.taskset.config.task)
        if self.env.taskset.system_prompt is not None:
            task = task.with_system_prompt(self.env.taskset.system_prompt)
        return task

    async def episode(self, client: Any, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """One episode of the environment on ``row`` against ``client``'s endpoint: the mean reward of its
        traces (one for a single-agent environment), and their rewards (``reward/<name>``) and metrics."""
        vf = self.vf
        os.environ[TOKEN_VAR] = client.api_key
        ctx = vf.ModelContext(
            model="policy",
            client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=TOKEN_VAR),
            sampling=vf.Sampling(),  # the run's sampling settings: the endpoint applies them
        )
        result = await self.env.run_episode(self.task(row), ctx)
        errors = [*result.errors, *(e for t in result.traces for e in t.errors)]
        if not result.ok or errors:
            first = errors[0] if errors else None
            raise RuntimeError(
                f"the verifiers episode failed: {first.type}: {first.message}"
                if first
                else "it did not finish"
            )
        metrics: dict[str, list[float]] = {}
        for trace in result.traces:
            for name, reward in trace.rewards.items():
                if reward is not None:
                    metrics.setdefault(f"reward/{name}", []).append(reward.score)
            for name, value in trace.metrics.items():
                if value is not None:
                    metrics.setdefault(name, []).append(value)
        reward = sum(t.reward for t in result.traces) / len(result.traces)
        return reward, {k: sum(v) / len(v) for k, v in metrics.items()}
