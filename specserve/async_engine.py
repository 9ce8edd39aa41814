"""The asynchronous engine: the synchronous step loop in a background thread.

Callers (HTTP handlers, scripts) only enqueue and consume: `generate()` is an async iterator of
per-step outputs (with deltas) that accepts requests at any time; leaving the iterator early,
or `abort(request_id)`, stops the request and frees its blocks. The loop thread owns the engine,
so nothing else touches it; requests and aborts reach it through a queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specserve.engine import LLMEngine, Prompt
from specserve.outputs import RequestOutput
from specserve.sampling import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


@dataclass
class _LoopFailure:
    error: BaseException


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput items; a request's own error; or the loop's failure

    def put(self, item: RequestOutput | Exception | _LoopFailure) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None
        # Called in the loop thread with every request's final output, aborted ones included
        # (the server's metrics: a client that went away still ended a request).
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread with an event loop) -------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its output after every step that advanced it."""
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
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, _LoopFailure):
                    raise EngineDeadError(f"the engine loop failed: {item.error!r}") from item.error
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)

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
                    self._handle(message)
                    block = False
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as error:  # noqa: BLE001 -- every waiting caller must hear about it
            self.error = error
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.put(_LoopFailure(error))
        finally:
            self._stopped = True

    def _handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, request_id, prompt, prompt_ids, params = message
            if request_id not in self._streams:  # aborted before it arrived
                return
            try:
                self.engine.add_request(request_id, prompt, params, prompt_ids)
            except ValueError as error:
                self._fail(request_id, error)
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
