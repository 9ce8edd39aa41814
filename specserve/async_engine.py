"""The asynchronous engine: the synchronous step loop in a background thread.

Callers (HTTP handlers, scripts) only enqueue and consume: `generate()` is an async iterator of
per-step outputs (with deltas) that accepts requests at any time; leaving the iterator early,
or `abort(request_id)`, stops the request and frees its blocks. The loop thread owns the engine,
so nothing else touches it; requests and aborts reach it through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.engine import LLMEngine, Prompt
from specserve.outputs import RequestOutput
from specserve.parallel import RankDiedError
from specserve.sampling import SamplingParams

if TYPE_CHECKING:
    from specserve.metrics import ServerMetrics

logger = logging.getLogger("specserve")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (its sampling, drafting or detokenizing raised); the
    engine goes on serving the others."""


@dataclass
class _LoopFailure:
    error: BaseException


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput items; a request's own error; or the loop's failure

    def put(self, item: RequestOutput | Exception | _LoopFailure) -> None:
        # RuntimeError: its event loop is closed (the server shut down), so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class RequestStream:
    """A submitted request's outputs as they come (`async for`). Closing it before the last one,
    iterated or not, aborts the request and frees its blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self._engine, self.request_id, self._stream = engine, request_id, stream
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._stream.outputs.get()
        if isinstance(item, _LoopFailure):
            self._finished = True
            raise EngineDeadError(f"the engine loop failed: {item.error!r}") from item.error
        if isinstance(item, Exception):
            self._finished = True
            raise item
        self._finished = item.finished
        if item.error is not None:
            raise RequestFailedError(f"the engine failed this request: {item.error}")
        return item

    async def aclose(self) -> None:
        if not self._finished:  # the consumer went away (client disconnect, cancellation)
            self._finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """`engine`, or better a function that builds it: then the loop thread builds it and does all
    of its torch work, from loading on. OpenMP gives every thread that starts parallel work a
    worker pool of its own; once two exist (the builder's and the loop's), libgomp counts more
    threads than cores and stops spinning between parallel regions, so each region waits for a
    sleeping worker (measured on 2 cores: a 1-row block matmul 35 -> 97 us, a SmolLM2 decode
    step 9.6 -> 18 ms). A build that fails raises here, in the caller."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        self.engine: LLMEngine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None
        # Called in the loop thread with every request's final output, aborted ones included
        # (the server's metrics: a client that went away still ended a request).
        self.on_finished: Callable[[RequestOutput], None] | None = None
        # Called in the loop thread once, if the loop itself fails (the server exits non-zero so a
        # supervisor restarts it, rather than answering 503 for ever).
        self.on_dead: Callable[[BaseException], None] | None = None
        built = threading.Event()
        build_error: list[BaseException] = []

        def run() -> None:
            try:
                self.engine = engine if isinstance(engine, LLMEngine) else engine()
            except BaseException as error:  # noqa: BLE001 -- re-raised in the caller below
                build_error.append(error)
                return
            finally:
                built.set()
            if self.engine.executor is not None:  # a dead tensor-parallel rank ends the loop, even idle
                self.engine.executor.on_failure = lambda message: self._inbox.put(("fatal", RankDiedError(message)))
            self._loop()

        self._thread = threading.Thread(target=run, name="specserve-engine", daemon=True)
        self._thread.start()
        built.wait()
        if build_error:
            self._stopped = True
            raise build_error[0]

    # -- caller side (any thread with an event loop) -------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Register a request now, synchronously (so `num_unfinished` counts it before the caller
        next awaits: admission limits hold under bursts), and return its outputs to iterate.
        Call from the thread of the event loop that will consume them."""
        if self.error is not None or self._stopped:
            raise EngineDeadError(f"the engine is not running: {self.error or 'shut down'}")
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        # Validate here, so bad input fails in the caller (a 4xx) rather than in the loop.
        prompt_ids = self.engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.engine.validate(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running: use a unique id")
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, prompt_ids, params))
        return RequestStream(self, request_id, stream)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its output after every step that advanced it."""
        outputs = self.submit(prompt, params, request_id)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)
        self.engine.close()

    async def metrics_text(self, server: ServerMetrics) -> str:
        """`/metrics`: the server's counters with the engine's state, read now."""
        return server.render(self.engine)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # -- the loop thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                # Block only while idle; otherwise take whatever arrived and run a step.
                block = not self.engine.has_unfinished()
                while True:
                    try:
                        message = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if message[0] == "stop":
                        return
                    if message[0] == "fatal":
                        raise message[1]
                    self._handle(message)
                    block = False
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as error:  # noqa: BLE001 -- every waiting caller must hear about it
            logger.critical("the engine loop stopped; no request can be served until a restart", exc_info=error)
            self.error = error
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.put(_LoopFailure(error))
            if self.on_dead is not None:
                self.on_dead(error)
        finally:
            self._stopped = True

    def _handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, request_id, prompt, prompt_ids, params = message
            if request_id not in self._streams:  # aborted before it arrived
                return
            try:
                self.engine.add_request(request_id, prompt, params, prompt_ids)
            except ValueError as error:  # bad input the caller's checks let through: the caller's 4xx
                self._fail(request_id, error)
            except Exception as error:  # noqa: BLE001 -- fails this request alone
                logger.error("request %s could not be added", request_id, exc_info=error)
                self._fail(request_id, RequestFailedError(f"the engine could not take this request: "
                                                          f"{type(error).__name__}: {error}"))
        elif message[0] == "abort":
            out = self.engine.abort(message[1])
            if out is not None:
                self._deliver(out)
            else:
                with self._lock:
                    self._streams.pop(message[1], None)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished and self.on_finished is not None:
            self.on_finished(out)
        with self._lock:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)

    def _fail(self, request_id: str, error: Exception) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)
