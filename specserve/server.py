"""`specserve serve`: the OpenAI-compatible HTTP server on the async engine.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as server-sent
events ending with `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus, see `specserve.metrics`). Errors have OpenAI's body
(`{"error": {"message", "type", "param", "code"}}`) and say what to change: 400 for bad input,
401, 413, 429 when --max-queued-requests are already queued (with Retry-After: back off, as from
TGI's "model is overloaded"), 500 for a request the engine failed alone (the others go on), 503
only when the engine cannot serve at all (it stopped; the process exits for a restart).
`/openapi.json` describes exactly that (`specserve.openapi`). A client that goes away, streaming
or not, aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from specserve.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_REQUESTS
from specserve.metrics import ServerMetrics
from specserve.openapi import openapi_schema
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    usage,
)
from specserve.sampling import SamplingParams

logger = logging.getLogger("specserve")
T = TypeVar("T")
RETRY_AFTER_SECONDS = 1  # what a 429 for a full queue tells clients to wait (OpenAI's SDK honours it)


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS  # requests in the engine (running or waiting) at most


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status)


def create_app(engine: AsyncEngine, settings: ServerSettings) -> ASGIApp:
    """The app, behind the API-key and body-size guard."""
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None)
    api = _Handlers(engine, settings)
    app.openapi = lambda: openapi_schema(app, settings.model_name)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
        return error_response(400, f"{where or 'body'}: {first.get('msg')} (got {_clipped(repr(first.get('input')))})",
                              param=where or None)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own errors (a body that does not parse, no such route) in OpenAI's shape."""
        cause = error.__cause__
        if isinstance(cause, UnicodeDecodeError):
            message = f"the request body is not valid UTF-8 (byte {cause.start}): send JSON encoded as UTF-8"
        elif isinstance(cause, RecursionError):
            message = "the request body's JSON is nested too deeply: send the fields as OpenAI's API documents them"
        elif error.status_code == 404:
            message = (f"no route {request.url.path}: use POST /v1/completions, POST /v1/chat/completions, "
                       f"GET /v1/models, GET /health or GET /metrics")
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: see GET /openapi.json"
        else:
            message = str(error.detail)
        response = error_response(error.status_code, message, code=None)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.error("unexpected error in a request handler", exc_info=error)
        return error_response(500, f"the server failed this request: {type(error).__name__}: {error}",
                              "server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error is not None:
            return error_response(503, f"the engine stopped: {engine.error!r}; the server is restarting",
                                  "server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await engine.metrics_text(api.metrics), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": now(), "owned_by": "specserve",
            "max_model_len": engine.engine.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    return _Guard(app, settings)


class DrainingServer(uvicorn.Server):
    """Ctrl-C / SIGTERM: uvicorn stops accepting, lets in-flight requests finish for up to
    --drain-seconds, then cancels the rest (which aborts them in the engine). Drained, the
    process exits 0 instead of uvicorn re-raising the signal (which would skip the engine's
    shutdown)."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def run_server(server: uvicorn.Server, engine: AsyncEngine) -> int:
    """Serve until a signal (exit 0 once drained) or until the engine loop dies (exit 1 at once,
    so that a supervisor restarts the process instead of it answering 503 for ever)."""

    def engine_died(_: BaseException) -> None:  # the engine logged it with its traceback
        server.should_exit = True

    engine.on_dead = engine_died
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        logger.critical("the engine stopped: %r; exiting with status 1 for a restart", engine.error)
        return 1
    return 0


def _clipped(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Handlers:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        tokenizer = engine.engine.tokenizer
        self.decode_token: Callable[[int], str] = lambda t: tokenizer.decode([t])
        self.metrics = ServerMetrics()
        engine.on_finished = self.metrics.observe
        # Requests admitted but not yet in the engine (being tokenized): counted with the engine's
        # own against --max-queued-requests, and taken before any await, so a burst cannot slip by.
        self.pending = 0
        # Tokenizing and chat templating take seconds for megabytes of text: never on the event loop.
        # One thread: encodes queue behind each other instead of crowding the engine's cores.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")
        # A token spans at most this many characters, so a longer text cannot fit the context.
        self.max_prompt_chars = engine.engine.max_model_len * max(len(t) for t in tokenizer.get_vocab())

    # -- completions ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        try:
            raw = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from error
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        params = self._params(lambda: body.sampling_params(max_tokens, body.logprobs))
        with self._admission(len(raw)) as admission:
            self._check_chars(sum(len(p) for p in raw if isinstance(p, str)), "prompt")
            encode = self.engine.engine.encode
            prompts = await self._off_loop(lambda: [encode(p) if isinstance(p, str) else list(p) for p in raw],
                                           "prompt")
            for ids in prompts:
                self._check_request(ids, params)
            streams = admission.submit(prompts, params)
        echoed = [(p if isinstance(p, str) else self.engine.engine.tokenizer.decode(ids)) if body.echo else ""
                  for p, ids in zip(raw, prompts, strict=True)]
        rid, created, model = new_id("cmpl"), now(), body.model
        outputs = await self._started(request, streams)
        prompt_tokens = sum(len(ids) for ids in prompts)

        def choice(i: int, out: RequestOutput, sample: int, text: str, start: int, offset: int,
                   finish: str | None) -> dict:
            entries = out.outputs[sample].logprobs
            logprobs = None if entries is None else completion_logprobs(entries[start:], self.decode_token, offset)
            return {"index": i * body.n + sample, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if body.stream:
            echoes = [{"index": i * body.n + sample, "text": text, "logprobs": None, "finish_reason": None}
                      for i, text in enumerate(echoed) if text for sample in range(body.n)]
            return _event_stream(_events(
                outputs, lambda chunk_choices: _chunk(rid, "text_completion", created, model, chunk_choices),
                [[c] for c in echoes],
                lambda i, out, c, start: choice(i, out, c.index, c.delta_text, start, 0,
                                                c.finish_reason if c.finished else None),
                prompt_tokens if body.include_usage else None))

        finals = await _until_disconnected(request, _finals(outputs, len(prompts)))
        choices = sorted((choice(i, out, c.index, echoed[i] + c.text, 0, len(echoed[i]), c.finish_reason)
                          for i, out in enumerate(finals) for c in out.outputs), key=lambda c: c["index"])
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(prompt_tokens, finals)})

    # -- chat -------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        try:
            conversation = body.conversation()
            logprobs = body.wanted_logprobs()
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        with self._admission(1) as admission:
            self._check_chars(sum(len(m["content"]) for m in conversation), "messages")
            ids = await self._off_loop(lambda: self.engine.engine.encode_chat(conversation), "messages")
            asked = body.max_completion_tokens or body.max_tokens
            # Without a limit, a reply may take whatever the context leaves (as OpenAI's does).
            max_tokens = asked or max(1, self.engine.engine.max_model_len - len(ids))
            params = self._params(lambda: body.sampling_params(max_tokens, logprobs))
            self._check_request(ids, params)
            streams = admission.submit([ids], params)
        rid, created, model = new_id("chatcmpl"), now(), body.model
        outputs = await self._started(request, streams)
        top = body.top_logprobs or 0

        def logprobs_of(out: RequestOutput, sample: int, start: int) -> dict | None:
            entries = out.outputs[sample].logprobs
            return None if entries is None else chat_logprobs(entries[start:], self.decode_token, top)

        if body.stream:
            roles = [[{"index": sample, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}] for sample in range(body.n)]  # the role first, as OpenAI's streams do
            return _event_stream(_events(
                outputs, lambda chunk_choices: _chunk(rid, "chat.completion.chunk", created, model, chunk_choices),
                roles,
                lambda _, out, c, start: {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                          "logprobs": logprobs_of(out, c.index, start),
                                          "finish_reason": c.finish_reason if c.finished else None},
                len(ids) if body.include_usage else None))

        (out,) = await _until_disconnected(request, _finals(outputs, 1))
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs_of(out, c.index, 0), "finish_reason": c.finish_reason}
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(len(ids), [out])})

    # -- shared -----------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(400, f"the model {model!r} is not served here: use {self.settings.model_name!r} "
                                f"(GET /v1/models lists it)", param="model", code="model_not_found")

    def _check_chars(self, chars: int, param: str) -> None:
        """A text too long for the context whatever its tokens, refused before tokenizing it."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.engine.engine.max_model_len} tokens, "
                                f"at most {self.max_prompt_chars} characters of text; your {param} has {chars} "
                                f"characters: shorten it", param=param, code="context_length_exceeded")

    async def _off_loop(self, work: Callable[[], T], param: str) -> T:
        """Tokenizing in the tokenizer thread: the event loop serves /health and streams meanwhile."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)
        except ValueError as error:
            raise APIError(400, str(error), param=param) from error

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """What the engine would refuse, refused here with a 400 before any stream starts."""
        limit = self.engine.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; your prompt has "
                                f"{len(prompt_ids)} tokens: shorten it", param="prompt",
                           code="context_length_exceeded")
        if len(prompt_ids) + params.max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; your prompt has "
                                f"{len(prompt_ids)} tokens and max_tokens asks for {params.max_tokens} more: "
                                f"lower max_tokens to at most {limit - len(prompt_ids)}", param="max_tokens",
                           code="context_length_exceeded")
        try:
            self.engine.engine.validate(prompt_ids, params)
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from error

    @staticmethod
    def _params(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValueError as error:
            raise APIError(400, str(error)) from error

    @contextmanager
    def _admission(self, count: int) -> Iterator[_Admission]:
        """Admit `count` requests or refuse them now (429), before the handler's first await."""
        if self.engine.error is not None:
            raise APIError(503, f"the engine stopped: {self.engine.error!r}; the server is restarting",
                           "server_error", code="engine_dead")
        limit = self.settings.max_queued_requests
        queued = self.engine.num_unfinished + self.pending
        if queued + count > limit:
            self.metrics.rejected["queue_full"] += 1
            raise APIError(429, f"the server is full: {queued} requests are queued or running (at most {limit}); "
                                f"retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        admission = _Admission(self, count)
        self.pending += count
        try:
            yield admission
        finally:
            admission.release()

    async def _started(self, request: Request, streams: list[RequestStream]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The requests' outputs, merged, once the first has arrived: whatever the engine refuses
        when it takes a request (a drafter it cannot build) is then still a 4xx, not a broken stream."""
        merged = _merged(streams)
        try:
            first = await _until_disconnected(request, anext(merged))
        except BaseException:
            await merged.aclose()
            for stream in streams:  # `merged` may not have started: close them all the same
                await stream.aclose()
            raise
        return _prepend(first, merged)


class _Admission:
    """Requests admitted by `_Handlers._admission`: pending until submitted to the engine, which
    then counts them (no await in between, so there is no moment where they count nowhere)."""

    def __init__(self, handlers: _Handlers, count: int):
        self.handlers, self.count = handlers, count

    def release(self) -> None:
        self.handlers.pending -= self.count
        self.count = 0

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestStream]:
        self.release()
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                streams.append(self.handlers.engine.submit(ids, params))
        except (EngineDeadError, ValueError):
            for stream in streams:  # all or none
                self.handlers.engine.abort(stream.request_id)
            with _api_errors():
                raise
        return streams


@contextmanager
def _api_errors() -> Iterator[None]:
    """Engine errors as API errors: bad input 400, a request the engine failed 500, a dead engine 503."""
    try:
        yield
    except EngineDeadError as error:
        raise APIError(503, f"{error}; the server is restarting", "server_error", code="engine_dead") from error
    except RequestFailedError as error:
        raise APIError(500, str(error), "server_error", code="request_failed") from error
    except ValueError as error:
        raise APIError(400, str(error)) from error


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come: (which request, output). Leaving early
    (a client gone) closes every stream, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as error:  # noqa: BLE001 -- handed to the consumer
            await queue.put((i, error))
        finally:
            await queue.put((i, done))

    tasks = []
    try:
        if len(streams) == 1:  # the common case, without a task in between
            with _api_errors():
                async for out in streams[0]:
                    yield 0, out
            return
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                with _api_errors():
                    raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _prepend(first: tuple[int, RequestOutput],
                   rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _finals(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """Each request's finished output, in request order."""
    finals: list[RequestOutput | None] = [None] * count
    async for i, out in outputs:
        finals[i] = out
    if None in finals or not all(out.finished for out in finals):
        raise APIError(500, "a request ended without its final output", "server_error")
    return finals


class _Sent:
    """What a stream has sent of each choice: its tokens so far, and whether its end went out."""

    def __init__(self) -> None:
        self._tokens: dict[tuple[int, int], int] = {}
        self._ended: set[tuple[int, int]] = set()

    def news(self, request: int, out: RequestOutput) -> list[tuple[CompletionOutput, int]]:
        """The choices of `out` with something new to send, each with how many tokens went before."""
        news = []
        for c in out.outputs:
            key = (request, c.index)
            start = self._tokens.get(key, 0)
            if key in self._ended or (len(c.token_ids) == start and not c.finished):
                continue
            self._tokens[key] = len(c.token_ids)
            if c.finished:
                self._ended.add(key)
            news.append((c, start))
        return news


async def _until_disconnected(request: Request, work: Awaitable[list[RequestOutput]]) -> list[RequestOutput]:
    """`work`, unless the client goes away first: then it is cancelled (its requests aborted)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the request")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _events(outputs: AsyncIterator[tuple[int, RequestOutput]], chunk: Callable[[list[dict]], dict],
                  first: list[list[dict]], choice: Callable[[int, RequestOutput, CompletionOutput, int], dict],
                  usage_prompt_tokens: int | None) -> AsyncIterator[str]:
    """A stream's server-sent events: `first` chunks' choices (echoed prompts, roles), then a chunk
    per output with news (`choice` of each choice with new tokens or its end, given how many
    tokens went before), a usage chunk when asked for (`usage_prompt_tokens`), and [DONE]."""
    for choices in first:
        yield _sse(chunk(choices))
    sent, finals = _Sent(), {}
    try:
        async for i, out in outputs:
            choices = [choice(i, out, c, start) for c, start in sent.news(i, out)]
            if out.finished:
                finals[i] = out
            if choices:
                yield _sse(chunk(choices))
    except APIError as error:  # the stream has begun: the error is its last event, as vLLM sends it
        yield _sse(error.body())
        yield "data: [DONE]\n\n"
        return
    if usage_prompt_tokens is not None:
        yield _sse({**chunk([]), "usage": usage(usage_prompt_tokens, list(finals.values()))})
    yield "data: [DONE]\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _chunk(rid: str, kind: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


class _Guard:
    """ASGI middleware in front of the app: the bearer token on the API (when a key is set; /health
    and /metrics stay open to probes and scrapers, as vLLM's do) and the request body size limit."""

    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.settings.api_key
        if key is not None and scope["path"].startswith("/v1/") and not _same(headers.get("authorization"),
                                                                               f"Bearer {key}"):
            response = error_response(401, "missing or wrong API key: send the header "
                                           "'Authorization: Bearer <key>' with the server's --api-key",
                                      "authentication_error", code="invalid_api_key")
            return await response(scope, receive, send)
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _too_large(limit)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await _too_large(limit)(scope, receive, send)
        except asyncio.CancelledError:
            # Only uvicorn cancels a request's task: when --drain-seconds run out at shutdown. Its
            # engine requests were aborted on the way out; ending quietly spares the log a traceback.
            logger.warning("%s %s cut short: the shutdown's drain time ran out", scope.get("method"), scope["path"])


def _same(given: str | None, expected: str) -> bool:
    """Constant time: how long a wrong key took to refuse says nothing about the right one."""
    return given is not None and hmac.compare_digest(given.encode("latin-1"), expected.encode())  # header bytes as sent


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body exceeds {limit} bytes: send a smaller request "
                               f"(or start the server with a larger --max-body-bytes)")
