"""A tiny chat model behind a running endpoint (the engine driven on a thread of its own), for the real
``openai`` client."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.models.tiny import IM_END_TOKEN, build_tiny_model_and_tokenizer
from hybridflow.serve.driver import EngineDriver
from hybridflow.serve.server import Endpoint, ServerSettings


class Served:
    """An endpoint whose engine runs on a background thread until ``close``."""

    def __init__(self, settings: ServerSettings, seed: int = 1) -> None:
        self.model, self.tokenizer = build_tiny_model_and_tokenizer(
            None, hidden_size=32, num_hidden_layers=2, seed=seed
        )
        self.model.eval()
        self.engine = PagedEngine(
            self.model, num_blocks=512, block_size=4, sync_interval=4, max_model_len=512
        )
        self.eos = [self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
        self.endpoint = Endpoint(
            EngineDriver(self.engine, self.tokenizer), self.tokenizer, self.eos, settings
        )
        self.endpoint.start()
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.endpoint.driver.run_until, args=(self.stop.is_set,), daemon=True
        )
        self.thread.start()

    def client(self, episode: str | None = None, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.endpoint.base_url(episode), api_key=self.endpoint.token, max_retries=0, **kwargs
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.endpoint.close()


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    s = Served(ServerSettings(tool_format="plain", max_body_bytes=64 << 10))
    yield s
    s.close()


CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# The conversation a tool-calling model is taught: two calls, then the answer (three assistant turns).
LESSON = [
    {"role": "user", "content": "What is 2*3*7?"},
    {"role": "assistant", "content": "[[calc: 2*3]]"},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "[[calc: 6*7]]"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "#### 42"},
]


def teach(model: Any, tokenizer: Any, steps: int = 150) -> None:
    """Fit the model to ``LESSON`` (every prefix ending in an assistant turn), so that greedy answers call."""
    import torch

    ids = torch.tensor([tokenizer.apply_chat_template(LESSON, tokenize=True, return_dict=False)])
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="session")
def caller() -> Iterator[Served]:
    """A served model that has learnt to answer ``LESSON``'s question by calling calc twice."""
    s = Served.__new__(Served)
    model, tokenizer = build_tiny_model_and_tokenizer(None, hidden_size=64, num_hidden_layers=2, seed=3)
    teach(model, tokenizer)
    s.model, s.tokenizer = model, tokenizer
    s.engine = PagedEngine(model, num_blocks=512, block_size=4, sync_interval=4, max_model_len=512)
    s.eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    s.endpoint = Endpoint(
        EngineDriver(s.engine, tokenizer), tokenizer, s.eos, ServerSettings(tool_format="plain")
    )
    s.endpoint.start()
    s.stop = threading.Event()
    s.thread = threading.Thread(target=s.endpoint.driver.run_until, args=(s.stop.is_set,), daemon=True)
    s.thread.start()
    yield s
    s.close()


def run_episodes(s: Served, runner: Any, rows: list[dict]) -> list[Any]:
    """``runner``'s episodes with the engine driven on this thread (as the trainer's rollout drives it)."""
    s.stop.set()
    s.thread.join(timeout=30)
    try:
        return runner.run(s.endpoint, rows)
    finally:
        s.stop.clear()
        s.thread = threading.Thread(target=s.endpoint.driver.run_until, args=(s.stop.is_set,), daemon=True)
        s.thread.start()
