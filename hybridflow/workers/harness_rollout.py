"""The actor's rollout through a user harness (``rollout.harness``): the endpoint on this rank's engine, the
episodes of a rollout, and their training rows packed as the batch the trainer reads.

Each prompt row is played ``n`` times (its episodes interleaved like samples, ``[a, a, b, b]``); an episode
gives one training row per sequence it left (``serve.trajectory``: usually one, several when the harness
rewrote its history), each carrying the episode's reward (``harness_reward``) and its prompt's ``uid``. So a
prompt's group may hold more (a split) or fewer (an episode dropped on error) rows than ``n``:
``meta["rows_per_prompt"]`` says how many, and the trainer repeats the prompts' fields by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.engine import pack_prompt_response, pad_rows
from hybridflow.protocol import Batch
from hybridflow.serve import require_packages
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:  # the endpoint's modules import aiohttp: only a run with rollout.harness loads them
    from hybridflow.serve.server import Endpoint

ROW_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "index")


class HarnessRollout:
    """Runs ``rollout.harness`` episodes on the actor's engine (see the module doc)."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        h = cfg.rollout.harness
        require_packages("rollout.harness")
        from hybridflow.serve.harness import HarnessRunner, load_harness
        from hybridflow.serve.server import ServerSettings

        if h.verifiers_env is not None:
            from hybridflow.serve.verifiers_env import VerifiersEnv

            env = VerifiersEnv(h.verifiers_env, h.verifiers_config)
            self.runner = HarnessRunner(env.episode, h.max_concurrency, h.timeout_s, h.on_error, env.serving)
        else:
            self.runner = HarnessRunner(
                load_harness(h.module, h.function), h.max_concurrency, h.timeout_s, h.on_error
            )
        self.tokenizer = tokenizer
        self.settings = ServerSettings(
            host=h.host, port=h.port, model_name=cfg.model.path or "hybridflow", tool_format=h.tool_format
        )
        self.max_response_length = cfg.data.max_response_length
        self.endpoint: Endpoint | None = None

    def _endpoint(self, engine: Any) -> Endpoint:
        """The endpoint on ``engine`` (started at the first rollout; the same port for the whole run)."""
        from hybridflow.serve.driver import EngineDriver
        from hybridflow.serve.server import Endpoint

        if self.endpoint is None or self.endpoint.driver.engine is not engine:
            if self.endpoint is not None:
                self.endpoint.close()
            self.endpoint = Endpoint(EngineDriver(engine, self.tokenizer), self.tokenizer, [], self.settings)
            self.endpoint.start()
        return self.endpoint

    def generate(
        self,
        engine: Any,
        prompts: Batch,
        params: Any,
        pad_token_id: int,
        progress: Callable[[int], None] | None,
    ) -> Batch:
        """``params.n`` episodes per prompt row, packed as training rows (see the module doc)."""
        if not hasattr(engine, "step"):
            raise UserError("rollout.harness serves on the built-in engine; set rollout.engine=native")
        endpoint = self._endpoint(engine)
        rows = [self._row(prompts, i) for i in range(len(prompts)) for _ in range(params.n)]
        endpoint.fixed, endpoint.response_budget = params, self.max_response_length
        endpoint.eos_ids = list(params.eos_token_ids)
        try:
            results = self.runner.run(endpoint, rows, progress)
        finally:
            endpoint.fixed = endpoint.response_budget = None
        return self._pack(results, len(prompts), params.n, pad_token_id)

    @staticmethod
    def _row(prompts: Batch, i: int) -> dict[str, Any]:
        """What the harness gets of a prompt: the dataset row's fields, and ``prompt_ids``."""
        row = {k: prompts[k][i] for k in ROW_KEYS if k in prompts.non_tensors}
        mask = prompts["attention_mask"][i].bool()
        row["prompt_ids"] = prompts["input_ids"][i][mask].tolist()
        return row

    def _pack(self, results: list[Any], num_prompts: int, n: int, pad_token_id: int) -> Batch:
        prompt_ids, responses, logprobs, masks, rewards, uids, counts = (
            [],
            [],
            [],
            [],
            [],
            [],
            [0] * num_prompts,
        )
        for k, result in enumerate(results):
            for seq in result.sequences:
                prompt_ids.append(seq.tokens[: seq.prompt_len])
                responses.append(seq.response)
                logprobs.append(
                    [0.0 if (m == 0 or math.isnan(p)) else p for p, m in zip(seq.logprobs, seq.mask)]
                )
                masks.append(seq.mask)
                rewards.append(result.reward)
                uids.append(str(k // n))
                counts[k // n] += 1
        if not responses:
            raise UserError(
                "no harness episode of this rollout sampled anything it could train on (every one failed, or "
                "none called the endpoint); the warnings above say why"
            )
        R = self.max_response_length
        batch = pack_prompt_response(prompt_ids, responses, R, pad_token_id)
        batch["rollout_log_probs"], _ = pad_rows(logprobs, R, 0.0, torch.float32)  # (rows, R)
        sampled, _ = pad_rows(masks, R, 0, torch.float32)  # (rows, R): 1 on sampled tokens only
        batch["response_mask"] = batch["response_mask"] * sampled
        batch["uid"] = np.array(uids, dtype=object)
        batch["harness_reward"] = np.array(rewards, dtype=object)
        batch["finish_reason"] = np.array(["stop"] * len(responses), dtype=object)
        batch.meta["rows_per_prompt"] = counts
        from hybridflow.serve.harness import harness_metrics

        batch.meta["multi_turn"] = harness_metrics(results)
        return batch

    def close(self) -> None:
        """Stop the endpoint."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
