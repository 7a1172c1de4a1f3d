"""The HTTP API (FastAPI): OpenAI-style completions and chat, models, health, metrics and
a profiler window over the engine's steps (/start_profile, /stop_profile).

Each generation request is validated into a `Job` (400 on any bad input), submitted to the
engine (503 when the queue is full or the engine is down) and then read token by token:
streamed as server-sent events (`data: {json}` chunks, then `data: [DONE]`) or collected into
one JSON body. A client that disconnects has its request cancelled on the engine; a request
cut by a stop string is cancelled there too. Every path that ends a request calls
`EngineClient.release`, so none keeps KV on the engine.

Nothing that grows with a request's size runs on the event loop: parsing, tokenizing and
checking a request (`_prepare`) run on one worker thread (`ServeState.prepare_pool`; one,
because a tokenizer is not safe to share between threads), so /health and running streams
keep answering while a huge prompt is tokenized and refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from cpmoe.engine.profiler import ACTIVITIES, DEFAULT_DIR, ProfileCommand
from cpmoe.engine.request import TokenEvent
from cpmoe.serve import jobs, logprobs as lp, protocol as api, responses
from cpmoe.serve.chat_output import ChatOutput
from cpmoe.serve.detokenize import TextStream
from cpmoe.serve.engine_client import EngineClient, EngineDown, QueueFull, RequestStream
from cpmoe.serve.metrics import Metrics


@dataclass
class ServeState:
    client: EngineClient
    tokenizer: object
    limits: jobs.Limits
    metrics: Metrics
    on_loop_ready: Callable[[asyncio.AbstractEventLoop], None]
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="cpmoe-prepare"))


class _Run:
    """One accepted choice being read from the engine: tokens -> text pieces."""

    def __init__(self, state: ServeState, stream: RequestStream, job: jobs.Job) -> None:
        self.state, self.stream, self.job = state, stream, job
        self.text = TextStream(state.tokenizer, job.stop, job.params.min_tokens)
        self.ids: list[int] = []
        self.events: list[TokenEvent] = []
        self.reason = "cancelled"  # what release() records unless the request ends normally
        # chat answers parsed for reasoning or tool calls (--reasoning-parser, tools)
        self.chat = (ChatOutput(job.reasoning, job.tool_calls)
                     if job.reasoning or job.tool_calls else None)

    async def step(self) -> tuple[str, TokenEvent | None, str | None]:
        """-> (text piece, token event, finish reason or None) for the next token; the event
        is None when the server aborted the request (it is stopping: finish "abort")."""
        ev = await self.stream.next()
        if ev is None:
            self.reason = "abort"
            return self.text.finish(), None, self.reason
        self.ids.append(ev.token)
        self.events.append(ev)
        # a stop token id ends the answer outside its text (SGLang trims it)
        trimmed = ev.finish == "stop" and ev.token in self.job.stop_token_ids
        piece = "" if trimmed else self.text.add(ev.token)
        if self.text.stopped:
            self.reason = "stop"
        elif ev.finish is not None:
            self.reason = ev.finish
            piece += self.text.finish()
        else:
            return piece, ev, None
        return piece, ev, self.reason

    async def collect(self) -> tuple[str, str]:
        pieces, finish = [self.job.echo or ""], None
        while finish is None:
            piece, _, finish = await self.step()
            pieces.append(piece)
        return "".join(pieces), finish

    def release(self) -> None:
        self.state.client.release(self.stream, self.reason)

    def deltas(self, piece: str, finish: str | None) -> list[dict]:
        """A chat piece -> its message deltas (the parsers' output, or the piece)."""
        if self.chat is None:
            return [{"content": piece}] if piece else []
        out = self.chat.feed(piece)
        return out + self.chat.finish() if finish is not None else out

    def finish_reason(self, finish: str) -> str:
        """OpenAI's "tool_calls" for an answer that ended with calls."""
        calls = self.chat is not None and self.chat.calls > 0
        return "tool_calls" if calls and finish == "stop" else finish


def _usage(runs: list[_Run]) -> dict:
    firsts = [r for r in runs if r.job.first_of_prompt]
    return responses.usage(sum(r.stream.prompt_tokens for r in firsts), sum(len(r.ids) for r in runs),
                     sum(r.stream.cached_tokens for r in firsts))


def _error(e: api.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _unavailable(message: str, code: str) -> api.ApiError:
    return api.ApiError(503, message, None, code, kind="service_unavailable_error")


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.on_loop_ready(asyncio.get_running_loop())
        yield
        state.prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cpmoe", lifespan=lifespan)
    name = state.limits.model_name

    @app.get("/health")
    async def health() -> JSONResponse:
        client = state.client
        if client.failure is not None:
            first = str(client.failure).splitlines()[0]
            return JSONResponse({"status": "failed", "error": first}, status_code=503)
        if not client.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok", "model": name,
                             "rank_pids": state.metrics.rank_pids})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "cpmoe"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != name:
            e = api.ApiError(404, f"model {model_id!r} does not exist; this server serves "
                                  f"{name!r}", "model", "model_not_found")
            return _error(e)
        return JSONResponse({"id": name, "object": "model", "created": 0, "owned_by": "cpmoe"})

    @app.post("/start_profile")
    async def start_profile(request: Request) -> JSONResponse:
        return _profile(state, await request.body(), start=True)

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        return _profile(state, b"", start=False)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(state, request, "chat")

    return app


def _profile(state: ServeState, raw: bytes, start: bool) -> JSONResponse:
    """/start_profile (body: `api.ProfileRequest`, may be empty) and /stop_profile: the
    command goes to the engine, whose ranks write the trace once the window closes."""
    try:
        if not start:
            cmd = ProfileCommand(start=False)
        else:
            req = api.parse_body(raw or b"{}", api.ProfileRequest)
            out = req.output_dir or os.environ.get("CPMOE_TORCH_PROFILER_DIR", DEFAULT_DIR)
            acts = ACTIVITIES if req.activities is None else tuple(req.activities)
            cmd = ProfileCommand.starting(out, req.num_steps, acts, req.record_shapes,
                                          req.with_stack)
        try:
            state.client.profile(cmd)
        except EngineDown as e:
            raise _unavailable(f"{e}; the server is shutting down", "engine_down") from None
    except api.ApiError as e:
        return _error(e)
    if not start:
        return JSONResponse({"status": "stopping"})
    return JSONResponse({"status": "started", "output_dir": cmd.output_dir, "name": cmd.name,
                         "num_steps": cmd.num_steps})


def _prepare(state: ServeState, raw: bytes, chat: bool) -> list[jobs.Job]:
    """Request body -> one Job per choice, or ApiError. Blocking (JSON, schema, tokenizer):
    runs on `state.prepare_pool`, never on the event loop."""
    req = api.parse_body(raw, api.ChatRequest if chat else api.CompletionRequest)
    if req.model not in (None, state.limits.model_name):
        raise api.ApiError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{state.limits.model_name!r}", "model", "model_not_found")
    jobs.warn_ignored(req, "chat" if chat else "completions")
    return (jobs.chat_jobs if chat else jobs.completion_jobs)(req, state.tokenizer, state.limits)


async def _generate(state: ServeState, request: Request, endpoint: str) -> Response:
    chat = endpoint == "chat"
    arrived = time.monotonic()  # server-side TTFT counts the body, parsing and tokenizing
    runs: list[_Run] = []
    try:
        raw = await request.body()
        jobs = await asyncio.get_running_loop().run_in_executor(state.prepare_pool, _prepare,
                                                                state, raw, chat)
        try:
            for job in jobs:
                runs.append(_Run(state, state.client.submit(job, arrived), job))
        except QueueFull as e:
            raise _unavailable(str(e), "queue_full") from None
        except EngineDown as e:
            raise _unavailable(f"{e}; the server is shutting down", "engine_down") from None
    except api.ApiError as e:
        for run in runs:  # the choices submitted before the queue filled
            run.release()
        state.metrics.requests[(endpoint, e.status)] += 1
        return _error(e)
    state.metrics.prompt_tokens += sum(len(j.prompt_ids) for j in jobs if j.first_of_prompt)
    rid = responses.new_id("chatcmpl" if chat else "cmpl")
    name = state.limits.model_name
    if jobs[0].stream:
        state.metrics.requests[(endpoint, 200)] += 1
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": responses.now(), "model": name}
        return StreamingResponse(_stream(state, runs, head, chat),
                                 media_type="text/event-stream")
    return await _respond(state, request, runs, rid, name, endpoint)


async def _respond(state: ServeState, request: Request, runs: list[_Run], rid: str, name: str,
                   endpoint: str) -> Response:
    gone = asyncio.ensure_future(_until_disconnect(request))
    work = asyncio.ensure_future(asyncio.gather(*(run.collect() for run in runs)))
    try:
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: nobody to answer
            work.cancel()
            state.metrics.requests[(endpoint, 499)] += 1
            return Response(status_code=499)
        try:
            results = work.result()
        except EngineDown:
            e = _unavailable("the engine failed while generating; the server is shutting down",
                             "engine_down")
            state.metrics.requests[(endpoint, 503)] += 1
            return _error(e)
    finally:
        gone.cancel()
        for run in runs:
            run.release()
    state.metrics.requests[(endpoint, 200)] += 1
    chat = endpoint == "chat"
    kept = (_best(runs, list(results), runs[0].job.n) if runs[0].job.best_of > 1
            else list(zip(runs, results)))
    choices = [_final_choice(state, run, text, finish, chat, index)
               for index, (run, (text, finish)) in enumerate(kept)]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": responses.now(), "model": name, "choices": choices,
                         "usage": _usage(runs)})


def _best(runs: list[_Run], results: list[tuple[str, str]], n: int
          ) -> list[tuple[_Run, tuple[str, str]]]:
    """best_of: of each prompt's candidates, the n with the highest mean log-probability per
    token (OpenAI's definition), best first; prompts in order."""
    per = runs[0].job.best_of
    kept = []
    for p in range(0, len(runs), per):
        group = list(zip(runs[p:p + per], results[p:p + per]))
        group.sort(key=lambda g: -sum(e.logprob for e in g[0].events)
                   / max(1, len(g[0].events)))
        kept += group[:n]
    return kept


def _final_choice(state: ServeState, run: _Run, text: str, finish: str, chat: bool,
                  index: int) -> dict:
    job = run.job
    ids = run.ids if job.return_token_ids or state.tokenizer is None else None
    logprobs = None
    if job.logprobs is not None and job.show_logprobs:
        logprobs = (lp.chat_logprobs(state.tokenizer, run.events) if chat else
                    lp.completion_logprobs(state.tokenizer, run.events, len(job.echo or "")))
    if not chat:
        if job.prompt_logprobs and logprobs is not None and run.events:
            logprobs = lp.joined(_prompt_logprobs(state, run), logprobs)
        return responses.completion_choice(text, finish, ids, index, logprobs)
    message = ({"role": "assistant", "content": text} if run.chat is None
               else run.chat.message(run.deltas(text, finish)))
    return responses.chat_choice(message, run.finish_reason(finish), ids, index, logprobs)


def _prompt_logprobs(state: ServeState, run: _Run) -> dict | None:
    """The prompt's part of a completion's logprobs (echo), from its first token event."""
    entries = run.events[0].prompt_logprobs if run.events else None
    if entries is None:
        return None
    return lp.prompt_completion_logprobs(state.tokenizer, run.job.prompt_ids, entries)


async def _tokens(run: _Run) -> AsyncIterator[tuple[str, list[TokenEvent], str | None]]:
    """-> (text piece, token events since the last piece, finish) per piece worth sending."""
    pending: list[TokenEvent] = []
    finish = None
    want_ids = run.job.return_token_ids or run.state.tokenizer is None
    while finish is None:
        piece, ev, finish = await run.step()
        if ev is not None:
            pending.append(ev)
        if piece or finish is not None or want_ids:
            yield piece, pending, finish
            pending = []


async def _choice_chunks(state: ServeState, run: _Run, chat: bool) -> AsyncIterator[dict]:
    """The choices of one run's chunks, in order: its opening, one per piece, its finish."""
    job = run.job
    want_ids = job.return_token_ids or state.tokenizer is None
    offset = len(job.echo or "")
    echo = not chat and job.echo
    if chat:
        yield responses.chat_delta({"role": "assistant", "content": ""}, None, index=job.index)
    elif echo and not job.prompt_logprobs:  # else with the prompt's logprobs, once known
        yield responses.completion_choice(job.echo, None, [] if want_ids else None, job.index)
        echo = False
    async for piece, events, finish in _tokens(run):
        ids = [ev.token for ev in events] if want_ids else None
        logprobs = None
        if job.logprobs is not None:
            logprobs = (lp.chat_logprobs(state.tokenizer, events) if chat else
                        lp.completion_logprobs(state.tokenizer, events, offset))
        offset += len(piece)
        if not chat:
            if echo:
                yield responses.completion_choice(job.echo, None, [] if want_ids else None, job.index,
                                            _prompt_logprobs(state, run))
                echo = False
            yield responses.completion_choice(piece, finish, ids, job.index, logprobs)
            continue
        deltas = run.deltas(piece, finish)
        if not deltas and (want_ids or logprobs is not None):
            deltas = [{"content": ""}]
        for i, delta in enumerate(deltas):  # ids and logprobs ride on the first
            yield responses.chat_delta(delta, None, ids if i == 0 else None, job.index,
                                 logprobs if i == 0 else None)
        if finish is not None:
            yield responses.chat_delta({}, run.finish_reason(finish), index=job.index)


async def _stream(state: ServeState, runs: list[_Run], head: dict, chat: bool
                  ) -> AsyncIterator[str]:
    """One request's SSE events: every choice's chunks as they come (one choice per chunk),
    usage if asked, [DONE]; an engine failure ends the stream with a 503 body."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            async for choice in _choice_chunks(state, run, chat):
                queue.put_nowait(choice)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001  (handed to the generator below)
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        left = len(runs)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, EngineDown):
                yield _sse(_unavailable("the engine failed while generating",
                                        "engine_down").body())
                return
            elif isinstance(item, Exception):
                raise item
            else:
                yield _sse({**head, "choices": [item]})
        if runs[0].job.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(runs)})
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for run in runs:
            run.release()
