"""Replicas behind Ray Serve: N engines, one OpenAI-compatible ingress, prefix-aware routing.

    client --HTTP--> Ray Serve proxy --> ingress (our OpenAI app: tokenizes, validates, streams)
                                          --handle, token ids--> engine replica (AsyncEngine) x N

The ingress runs `specserve.server`'s app over a `ReplicaClient` in place of the engine, so the
API, its errors and its streaming are the single server's. Requests reach the replicas through
a deployment handle whose router is Ray Serve's `PrefixCacheAffinityRouter`: a request goes to
the replica whose recent prompts share the longest prefix with it (its prefix cache then holds
those blocks), unless the replicas' loads are too uneven. The router matches characters, so the
ingress hands it the prompt's token ids as one character each: a shared token prefix is a shared
string prefix. `GET /metrics` gathers every replica's metrics, each sample labelled with its
replica. Ray is an optional extra: `pip install -e ".[scale]"`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.frontend import Frontend
from specserve.outputs import RequestOutput
from specserve.sampling import SamplingParams

if TYPE_CHECKING:
    from specserve.metrics import ServerMetrics
    from specserve.server import ServerSettings

logger = logging.getLogger("specserve")

# Ray Serve's prefix-aware router (ray.serve.llm's, importable without vLLM from where it lives)
PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                 "PrefixCacheAffinityRouter")
ENGINE_DEPLOYMENT = "SpecserveEngine"
INGRESS_DEPLOYMENT = "SpecserveIngress"
# Ray Serve's HTTP proxy must answer within this (its default, 5 s, is too short for a busy 2-core host)
PROXY_READY_TIMEOUT_S = "60"


@dataclass
class ReplicaCall:
    """One request as the ingress hands it to a replica."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams

    @property
    def prompt(self) -> str:
        """What the prefix router matches on: one character per token id (exact token prefixes)."""
        return "".join(map(chr, self.prompt_ids))


# -- the replicas ---------------------------------------------------------------------------------

class EngineReplica:
    """One engine (`AsyncEngine`) as a Ray Serve deployment replica, built from the settings
    `specserve serve` takes (`LLM` keyword arguments: target, draft, ...)."""

    def __init__(self, settings: dict[str, Any]):
        from ray import serve

        from specserve.async_engine import AsyncEngine
        from specserve.llm import LLM
        from specserve.metrics import ServerMetrics

        self.engine = AsyncEngine(lambda: LLM(**settings).engine)  # built in its loop thread, as `serve` does
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = ServerMetrics()
        self.engine.on_finished = self.metrics.observe
        logger.info("replica %s serving %s", self.replica, self.engine.engine.model_path)

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to tokenize and check requests as this replica would."""
        engine = self.engine.engine
        return {"limits": engine.frontend.limits, "model_path": str(engine.model_path),
                "load_format": engine.config.load_format}

    async def generate(self, call: ReplicaCall) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; cancelling the stream aborts the request here."""
        stream = self.engine.submit(call.prompt_ids, call.params, call.request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def metrics_text(self) -> str:
        """This replica's `/metrics`, every sample labelled `replica="<id>"`."""
        return label_samples(self.metrics.render(self.engine.engine), "replica", self.replica)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# -- the ingress ----------------------------------------------------------------------------------

class RemoteStream:
    """A request's outputs from its replica, as `AsyncEngine.submit`'s stream gives them."""

    def __init__(self, client: ReplicaClient, request_id: str, response: Any):
        self.request_id, self._client, self._response = request_id, client, response
        self._finished = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        from specserve.async_engine import RequestFailedError

        if self._finished:
            raise StopAsyncIteration
        try:
            out = await self._response.__anext__()
        except BaseException:
            self._end()
            raise
        if out.finished:
            self._end()
            if self._client.on_finished is not None:
                self._client.on_finished(out)
        if out.error is not None:
            self._end()
            raise RequestFailedError(f"the engine failed this request: {out.error}")
        return out

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """The consumer went away: the replica aborts the request (its generator is cancelled)."""
        if not self._finished:
            self._end()
            self._response.cancel()

    def _end(self) -> None:
        self._finished = True
        self._client.streams.pop(self.request_id, None)


class ReplicaClient:
    """What the server's handlers use of an `AsyncEngine`, served by the replicas behind a
    deployment handle: `engine` (here a `Frontend`), `submit`, `abort`, counts and metrics."""

    def __init__(self, handle: Any, frontend: Frontend):
        self.handle, self.engine = handle, frontend
        self.streams: dict[str, RemoteStream] = {}
        self.error: BaseException | None = None
        self.on_finished = None
        self.on_dead = None

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RemoteStream:
        request_id = request_id or uuid.uuid4().hex
        call = ReplicaCall(request_id, list(prompt_ids), params or SamplingParams())
        stream = RemoteStream(self, request_id, self.handle.options(stream=True).generate.remote(call))
        self.streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.cancel()

    async def metrics_text(self, server: ServerMetrics) -> str:
        """Every replica's metrics, merged into one exposition (the ingress's own add nothing)."""
        texts = await asyncio.to_thread(lambda: self.handle.broadcast("metrics_text").results())
        return merge_expositions(texts)

    def shutdown(self) -> None:
        pass


class Ingress:
    """The OpenAI-compatible front: `specserve.server`'s app over the replicas."""

    def __init__(self, engine_handle: Any, settings: ServerSettings):
        self.engine_handle, self.settings = engine_handle, settings

    async def __serve_build_asgi_app__(self):
        """The app, once a replica has said what it serves (its tokenizer's directory, its limits)."""
        from specserve.detokenizer import load_tokenizer
        from specserve.models.config import ModelConfig
        from specserve.server import create_app

        description = await self.engine_handle.describe.remote()
        path = Path(description["model_path"])
        config = ModelConfig.from_dir(path) if description["load_format"] == "dummy" else None
        frontend = Frontend(load_tokenizer(path, config), description["limits"])
        return create_app(ReplicaClient(self.engine_handle, frontend), self.settings)


def build_app(engine_settings: dict[str, Any], settings: ServerSettings, replicas: int,
              max_ongoing_requests: int | None = None):
    """The Ray Serve application: `replicas` engines behind one ingress (`serve.run` it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    ongoing = max_ongoing_requests or settings.max_queued_requests
    engines = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=replicas,
                               max_ongoing_requests=ongoing,
                               request_router_config=RequestRouterConfig(request_router_class=PREFIX_ROUTER))
    # The ingress only tokenizes and relays: no CPU of its own in Ray's accounting, so that N
    # engines fit a machine of N cores.
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT,
                               max_ongoing_requests=ongoing * replicas, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines.bind(engine_settings), settings)


def run(engine_settings: dict[str, Any], settings: ServerSettings, replicas: int, host: str, port: int) -> int:
    """`specserve serve --replicas N`: a local Ray (or the cluster RAY_ADDRESS names), the
    application on host:port, until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError as error:
        raise ValueError('--replicas needs Ray Serve: pip install -e ".[scale]"') from error
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_TIMEOUT_S)
    address = os.environ.get("RAY_ADDRESS")
    # A local Ray counts at least one CPU per replica: more replicas than cores share them
    cpus = None if address else max(os.cpu_count() or 1, replicas)
    ray.init(address=address, num_cpus=cpus, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(engine_settings, settings, replicas), name="specserve", route_prefix="/")
    logger.info("%d replicas of %s behind http://%s:%d/v1 (Ray Serve)", replicas, engine_settings["target"], host,
                port)
    try:
        asyncio.run(_forever())
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


async def _forever() -> None:
    await asyncio.Event().wait()


# -- metrics --------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?( .*)$")


def label_samples(text: str, key: str, value: str) -> str:
    """Prometheus text with `key="value"` added to every sample's labels."""
    out = []
    for line in text.splitlines():
        match = None if line.startswith("#") else _SAMPLE.match(line)
        if match is None:
            out.append(line)
            continue
        name, _, labels, rest = match.groups()
        labels = f'{key}="{value}"' + (f",{labels}" if labels else "")
        out.append(f"{name}{{{labels}}}{rest}")
    return "\n".join(out) + "\n"


def merge_expositions(texts: list[str]) -> str:
    """Several Prometheus texts as one: each family's HELP and TYPE once, its samples from all."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    current = ""
    for line in itertools.chain.from_iterable(t.splitlines() for t in texts):
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            current = line.split()[2]
            headers.setdefault(current, [])
            if line not in headers[current]:
                headers[current].append(line)
            families.setdefault(current, [])
        elif line:
            families.setdefault(current, []).append(line)
    lines = [line for name, samples in families.items() for line in (*headers.get(name, []), *samples)]
    return "\n".join(lines) + "\n"
