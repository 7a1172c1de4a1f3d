"""The HTTP API (FastAPI): OpenAI-style completions and chat, models, health and metrics.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from cpmoe.serve import protocol as api
from cpmoe.serve.detokenize import TextStream
from cpmoe.serve.engine_client import EngineClient, EngineDown, QueueFull, RequestStream
from cpmoe.serve.metrics import Metrics


@dataclass
class ServeState:
    client: EngineClient
    tokenizer: object
    limits: api.Limits
    metrics: Metrics
    on_loop_ready: Callable[[asyncio.AbstractEventLoop], None]
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="cpmoe-prepare"))


class _Run:
    """One accepted request being read from the engine: tokens -> text pieces."""

    def __init__(self, state: ServeState, stream: RequestStream, job: api.Job) -> None:
        self.state, self.stream, self.job = state, stream, job
        self.text = TextStream(state.tokenizer, job.stop)
        self.ids: list[int] = []
        self.reason = "cancelled"  # what release() records unless the request ends normally

    async def step(self) -> tuple[str, int, str | None]:
        """-> (text piece, token id, finish reason or None) for the next token."""
        ev = await self.stream.next()
        self.ids.append(ev.token)
        piece = self.text.add(ev.token)
        if self.text.stopped:
            self.reason = "stop"
        elif ev.finish is not None:
            self.reason = ev.finish
            piece += self.text.finish()
        else:
            return piece, ev.token, None
        return piece, ev.token, self.reason

    async def collect(self) -> tuple[str, str]:
        pieces, finish = [], None
        while finish is None:
            piece, _, finish = await self.step()
            pieces.append(piece)
        return "".join(pieces), finish

    def usage(self) -> dict[str, int]:
        return api.usage(self.stream.prompt_tokens, len(self.ids))

    def release(self) -> None:
        self.state.client.release(self.stream, self.reason)


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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(state, request, "chat")

    return app


def _prepare(state: ServeState, raw: bytes, chat: bool) -> api.Job:
    """Request body -> Job, or ApiError. Blocking (JSON, schema, tokenizer): runs on
    `state.prepare_pool`, never on the event loop."""
    req = api.parse_body(raw, api.ChatRequest if chat else api.CompletionRequest)
    if req.model not in (None, state.limits.model_name):
        raise api.ApiError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{state.limits.model_name!r}", "model", "model_not_found")
    return (api.chat_job if chat else api.completion_job)(req, state.tokenizer, state.limits)


async def _generate(state: ServeState, request: Request, endpoint: str) -> Response:
    chat = endpoint == "chat"
    try:
        raw = await request.body()
        job = await asyncio.get_running_loop().run_in_executor(state.prepare_pool, _prepare,
                                                               state, raw, chat)
        try:
            stream = state.client.submit(job)
        except QueueFull as e:
            raise _unavailable(str(e), "queue_full") from None
        except EngineDown as e:
            raise _unavailable(f"{e}; the server is shutting down", "engine_down") from None
    except api.ApiError as e:
        state.metrics.requests[(endpoint, e.status)] += 1
        return _error(e)
    state.metrics.prompt_tokens += len(job.prompt_ids)
    run = _Run(state, stream, job)
    rid = api.new_id("chatcmpl" if chat else "cmpl")
    if job.stream:
        state.metrics.requests[(endpoint, 200)] += 1
        name = state.limits.model_name
        events = _chat_events(run, rid, name) if chat else _completion_events(run, rid, name)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _respond(state, request, run, rid, state.limits.model_name, endpoint)


async def _respond(state: ServeState, request: Request, run: _Run, rid: str, name: str,
                   endpoint: str) -> Response:
    gone = asyncio.ensure_future(_until_disconnect(request))
    work = asyncio.ensure_future(run.collect())
    try:
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: nobody to answer
            work.cancel()
            state.metrics.requests[(endpoint, 499)] += 1
            return Response(status_code=499)
        try:
            text, finish = work.result()
        except EngineDown:
            e = _unavailable("the engine failed while generating; the server is shutting down",
                             "engine_down")
            state.metrics.requests[(endpoint, 503)] += 1
            return _error(e)
    finally:
        gone.cancel()
        run.release()
    state.metrics.requests[(endpoint, 200)] += 1
    ids = run.ids if run.job.return_token_ids else None
    choice = (api.chat_choice if endpoint == "chat" else api.completion_choice)(text, finish, ids)
    return JSONResponse({"id": rid, "object": "chat.completion" if endpoint == "chat"
                         else "text_completion", "created": api.now(), "model": name,
                         "choices": [choice], "usage": run.usage()})


async def _tokens(run: _Run) -> AsyncIterator[tuple[str, list[int], str | None]]:
    """-> (text piece, token ids since the last piece, finish) per piece worth sending."""
    pending: list[int] = []
    finish = None
    while finish is None:
        piece, token, finish = await run.step()
        pending.append(token)
        if piece or finish is not None or run.job.return_token_ids:
            yield piece, pending, finish
            pending = []


def _completion_events(run: _Run, rid: str, name: str) -> AsyncIterator[str]:
    want_ids = run.job.return_token_ids

    def chunks(piece: str, ids: list[int], finish: str | None) -> list[list[dict]]:
        return [[api.completion_choice(piece, finish, ids if want_ids else None)]]

    head = {"id": rid, "object": "text_completion", "created": api.now(), "model": name}
    return _stream(run, head, [], chunks)


def _chat_events(run: _Run, rid: str, name: str) -> AsyncIterator[str]:
    want_ids = run.job.return_token_ids

    def chunks(piece: str, ids: list[int], finish: str | None) -> list[list[dict]]:
        out = []
        if piece or want_ids:
            out.append([api.chat_delta({"content": piece}, None, ids if want_ids else None)])
        if finish is not None:
            out.append([api.chat_delta({}, finish)])
        return out

    head = {"id": rid, "object": "chat.completion.chunk", "created": api.now(), "model": name}
    opening = [[api.chat_delta({"role": "assistant", "content": ""}, None)]]
    return _stream(run, head, opening, chunks)


async def _stream(run: _Run, head: dict, opening: list[list[dict]], chunks
                  ) -> AsyncIterator[str]:
    """One request's SSE events: the opening choices, the choices `chunks` makes of every
    decoded step, usage if asked, [DONE]; an engine failure ends the stream with a 503 body."""
    try:
        for choices in opening:
            yield _sse({**head, "choices": choices})
        async for piece, ids, finish in _tokens(run):
            for choices in chunks(piece, ids, finish):
                yield _sse({**head, "choices": choices})
        if run.job.include_usage:
            yield _sse({**head, "choices": [], "usage": run.usage()})
        yield "data: [DONE]\n\n"
    except EngineDown:
        yield _sse(_unavailable("the engine failed while generating", "engine_down").body())
    finally:
        run.release()
