"""The OpenAI-compatible HTTP endpoint on the paged engine (aiohttp): ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, and the same under ``/ep/<episode key>/v1/`` for an episode whose
requests are kept token-exact (``trajectory.Trajectory``).

The server's event loop runs on a thread of its own; the engine runs where ``driver.run_until`` is called
(the trainer's rollout, or ``hybridflow serve``'s main thread). A handler validates the request (HTTP 400 with a
message naming the field), renders and matches its prompt, hands the engine a job and awaits it: the requests
of every episode decode in the same batches. Every request must carry ``Authorization: Bearer <token>`` (the
run's token, HTTP 401 otherwise); a body over ``max_body_bytes`` is refused (HTTP 413). It listens on
127.0.0.1 unless told otherwise.

Sampling: ``fixed`` (the trainer's) pins the distribution the trainer's log-probs are taken at: a request may
leave ``temperature`` and ``top_p`` out or give the same values, any other is refused (HTTP 400 naming the
run's values). Without it (``hybridflow serve``) each request's own apply. ``response_budget`` (the trainer's
``data.max_response_length``) caps each training row: an answer may take what its row has left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hybridflow.engine import SamplingParams
from hybridflow.serve.driver import Choice, EngineDriver, Job
from hybridflow.serve.openai_format import (
    Request,
    RequestError,
    envelope,
    parse_chat,
    parse_completion,
    parse_tool_calls,
    render,
    token_logprobs,
)
from hybridflow.serve.trajectory import Prompt, Trajectory, message_key
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """Where and how the endpoint serves."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    token: str | None = None  # None: a fresh random one
    model_name: str = "hybridflow"
    max_body_bytes: int = 4 << 20
    tool_format: str = "hermes"  # how tool calls are parsed out of answers (tools.find_calls)
    default_max_tokens: int = 1024


class Endpoint:
    """The HTTP server, its episodes, and the engine driver behind it (see the module doc)."""

    def __init__(self, driver: EngineDriver, tokenizer: Any, eos_ids: list[int], settings: ServerSettings):
        self.driver, self.tokenizer, self.eos_ids, self.settings = driver, tokenizer, list(eos_ids), settings
        self.token = settings.token or secrets.token_urlsafe(24)
        self.fixed: SamplingParams | None = None  # the trainer's sampling settings while it rolls out
        self.response_budget: int | None = None
        self.episodes: dict[str, Trajectory] = {}
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="endpoint", daemon=True)

    # ---- life --------------------------------------------------------------------------------------------

    def start(self) -> Endpoint:
        """Bind and serve (on the endpoint's own thread); returns self with ``port`` set."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        logger.info("OpenAI-compatible endpoint on %s", self.base_url())
        return self

    async def _start(self) -> None:
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._guard])
        for prefix in ("/v1", "/ep/{episode}/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_get(prefix + "/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        try:
            await site.start()
        except OSError as exc:
            raise UserError(
                f"cannot listen on {self.settings.host}:{self.settings.port} ({exc}); pick another --port"
            ) from exc
        self.port = site._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop serving and end the loop's thread."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=10)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def base_url(self, episode: str | None = None) -> str:
        """The OpenAI base URL (``.../v1``), of one episode when ``episode`` is given."""
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        middle = f"/ep/{episode}" if episode else ""
        return f"http://{host}:{self.port}{middle}/v1"

    def open_episode(self) -> tuple[str, Trajectory]:
        """A new episode: its key (part of its base URL) and its trajectory."""
        key = secrets.token_hex(8)
        self.episodes[key] = Trajectory(self.tokenizer)
        return key, self.episodes[key]

    def close_episode(self, key: str) -> Trajectory:
        """Forget an episode (later requests under its key get 404); returns its trajectory."""
        return self.episodes.pop(key)

    # ---- HTTP --------------------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return _error(
                401, "missing or wrong bearer token: send 'Authorization: Bearer <the run's token>'"
            )
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(exc.status, str(exc))
        except web.HTTPRequestEntityTooLarge:
            limit = self.settings.max_body_bytes
            return _error(413, f"the request body is over the server's limit of {limit} bytes")
        except web.HTTPException as exc:
            return _error(exc.status, exc.reason or "error")

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "hybridflow"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat(await _body(request)))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion(await _body(request)))

    async def _serve(self, request: web.Request, req: Request) -> web.StreamResponse:
        key = request.match_info.get("episode")
        traj = None
        if key is not None:
            traj = self.episodes.get(key)
            if traj is None:
                raise RequestError(f"no episode {key!r} is running (it ended or never began)", 404)
            req.messages = traj.raw_messages(req.messages)
        text = render(self.tokenizer, req)
        prompt = (
            traj.prompt(text)
            if traj
            else Prompt(self.tokenizer.encode(text, add_special_tokens=False), None, 0)
        )
        job = self._job(req, prompt)
        if req.stream:
            return await self._stream(request, req, job, prompt, traj)
        choices = await self._run(job)
        answers = [self._answer(req, c, prompt, traj, i) for i, c in enumerate(choices)]
        usage = _usage(prompt, choices)
        kind = "chat" if req.kind == "chat" else "text"
        return web.json_response(envelope(kind, self._model(req), answers, usage))

    def _job(self, req: Request, prompt: Prompt, progress: Any = None) -> Job:
        """The engine job of a request: its sampling settings and its token budget."""
        if len(prompt.ids) >= self.driver.engine.max_len:
            raise RequestError(
                f"the prompt has {len(prompt.ids)} tokens, the model's context {self.driver.engine.max_len}: "
                "shorten the conversation"
            )
        budget = req.max_tokens or self.settings.default_max_tokens
        if self.response_budget is not None:
            left = self.response_budget - prompt.response_so_far
            if left <= 0:
                raise RequestError(
                    f"this episode's training row has spent its {self.response_budget} response tokens "
                    "(data.max_response_length); end the episode or start a new conversation"
                )
            budget = min(budget, left)
        return Job(
            list(prompt.ids), self._params(req), budget, done=lambda r: None, stop=req.stop, progress=progress
        )

    def _params(self, req: Request) -> SamplingParams:
        cap = self.driver.engine.max_len  # one max_new_tokens for every job: budgets go in Job.max_new
        fixed = self.fixed
        if fixed is not None:
            for name, given, run in (("temperature", req.temperature, fixed.temperature),
                                     ("top_p", req.top_p, fixed.top_p)):  # fmt: skip
                if (
                    given is not None
                    and abs(given - run) > 1e-6
                    and not (name == "temperature" and fixed.greedy and given == 0)
                ):
                    raise RequestError(
                        f"'{name}'={given} differs from the run's {name}={run}: the trainer's log-probs are "
                        f"taken at the run's settings; leave '{name}' out or send {run}"
                    )
            return dataclasses.replace(fixed, n=req.n, max_new_tokens=cap, logprobs=True)
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(
            n=req.n, max_new_tokens=cap, temperature=temperature, top_p=req.top_p or 1.0,
            do_sample=temperature > 0, eos_token_ids=self.eos_ids,
        )  # fmt: skip

    async def _run(self, job: Job) -> list[Choice]:
        """Hand the job to the engine and await its choices."""
        future = self.loop.create_future()

        def done(result: Any) -> None:
            def settle() -> None:
                if future.done():
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

            self.loop.call_soon_threadsafe(settle)

        job.done = done
        self.driver.submit(job)
        try:
            return await future
        except RuntimeError as exc:  # the engine could not serve it (the run is over, the pool too small)
            raise RequestError(str(exc), 503) from exc
        except (UserError, ValueError) as exc:
            raise RequestError(str(exc)) from exc

    def _text(self, choice: Choice) -> tuple[str, list[int], list[float]]:
        """An answer's text, without the end-of-turn token that ended it (kept in the trajectory)."""
        tokens, lps = choice.tokens, choice.logprobs
        ends = set(self.eos_ids) | set(self.fixed.stop_token_ids if self.fixed else ())
        if choice.finish_reason in ("eos", "stop") and tokens and tokens[-1] in ends:
            tokens, lps = tokens[:-1], lps[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False), tokens, lps

    def _answer(
        self, req: Request, choice: Choice, prompt: Prompt, traj: Trajectory | None, i: int = 0
    ) -> dict:
        """One choice of the response, recorded in the episode's trajectory."""
        raw, tokens, lps = self._text(choice)
        content, calls = (
            parse_tool_calls(raw, req, self.settings.tool_format) if req.kind == "chat" else (raw, None)
        )
        shown = content
        for stop in req.stop:  # the stop string is not part of the content (it is of the trained tokens)
            if choice.finish_reason == "stop" and shown and shown.endswith(stop):
                shown = shown[: -len(stop)]
        if traj is not None and choice.finish_reason != "abort":
            ended = len(tokens) < len(
                choice.tokens
            )  # the end-of-turn token is in the trajectory, not the text
            traj.record(
                prompt, choice.tokens, choice.logprobs, choice.versions, message_key(shown, calls), raw, ended
            )
        reason = "tool_calls" if calls else ("length" if choice.finish_reason == "length" else "stop")
        out: dict[str, Any] = {"index": i, "finish_reason": reason}
        logprobs = {"content": token_logprobs(self.tokenizer, tokens, lps)} if req.logprobs else None
        if req.kind == "chat":
            out["message"] = {"role": "assistant", "content": shown}
            if calls:
                out["message"]["tool_calls"] = calls
            out["logprobs"] = logprobs
        else:
            out["text"] = shown
            out["logprobs"] = None if logprobs is None else {
                "tokens": [e["token"] for e in logprobs["content"]],
                "token_logprobs": [e["logprob"] for e in logprobs["content"]],
                "top_logprobs": None, "text_offset": [],
            }  # fmt: skip
        return out

    def _model(self, req: Request) -> str:
        return req.model or self.settings.model_name

    # ---- streaming ---------------------------------------------------------------------------------------

    async def _stream(
        self, request: web.Request, req: Request, job: Job, prompt: Prompt, traj: Trajectory | None
    ) -> web.StreamResponse:
        """Server-sent events: content deltas as tokens arrive (all at the end when tools are offered, since
        a call is only known whole), then each choice's finish, the usage if asked, and ``[DONE]``."""
        updates: asyncio.Queue = asyncio.Queue()
        job.progress = lambda i, tokens: self.loop.call_soon_threadsafe(updates.put_nowait, (i, tokens))
        task = asyncio.ensure_future(self._run(job))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        sent = [""] * req.n
        hold = max((len(s) for s in req.stop), default=1) - 1
        model, chat = self._model(req), req.kind == "chat"
        kind = "chunk" if chat else "text"
        if chat:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(req.n)
            ]
            await _send(response, envelope(kind, model, first, None))
        while not task.done() or not updates.empty():
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            i, tokens = getter.result()
            if req.tools and chat:
                continue
            text = self.tokenizer.decode(
                [t for t in tokens if t not in self.eos_ids], skip_special_tokens=False
            )
            safe = text[: len(text) - hold] if hold else text
            safe = safe.rstrip("\ufffd")
            if len(safe) > len(sent[i]) and safe.startswith(sent[i]):
                await _send(response, envelope(kind, model, [_delta(chat, i, safe[len(sent[i]) :])], None))
                sent[i] = safe
        choices = task.result()
        for i, choice in enumerate(choices):
            full = self._answer(req, choice, prompt, traj, i)
            if chat:
                msg = full["message"]
                delta: dict[str, Any] = {}
                rest = (
                    (msg["content"] or "")[len(sent[i]) :]
                    if (msg["content"] or "").startswith(sent[i])
                    else ""
                )
                if rest:
                    delta["content"] = rest
                if msg.get("tool_calls"):
                    delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(msg["tool_calls"])]
                end = {
                    "index": i,
                    "delta": delta,
                    "finish_reason": full["finish_reason"],
                    "logprobs": full["logprobs"],
                }
            else:
                rest = full["text"][len(sent[i]) :] if full["text"].startswith(sent[i]) else ""
                end = {
                    "index": i,
                    "text": rest,
                    "finish_reason": full["finish_reason"],
                    "logprobs": full["logprobs"],
                }
            await _send(response, envelope(kind, model, [end], None))
        if req.include_usage:
            await _send(response, envelope(kind, model, [], _usage(prompt, choices)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _delta(chat: bool, i: int, text: str) -> dict[str, Any]:
    if chat:
        return {"index": i, "delta": {"content": text}, "finish_reason": None}
    return {"index": i, "text": text, "finish_reason": None, "logprobs": None}


async def _send(response: web.StreamResponse, obj: dict) -> None:
    await response.write(f"data: {json.dumps(obj)}\n\n".encode())


def _usage(prompt: Prompt, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(prompt.ids), "completion_tokens": completion,
            "total_tokens": len(prompt.ids) + completion}  # fmt: skip


async def _body(request: web.Request) -> Any:
    """The request's JSON (HTTP 400 when it is not JSON, 413 when too large)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from exc


def _error(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "error"
    )
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
