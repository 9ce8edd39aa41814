"""Replicas behind Ray Serve (local Ray, CPU, the tiny dummy model): the OpenAI SDK streams through
the ingress; requests sharing a long prompt prefix land on one replica, whose prefix cache then
serves them; `/metrics` shows every replica, each sample labelled with it."""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from specserve.machine import free_port
from specserve.replicas import ReplicaCall, label_samples, merge_expositions
from specserve.sampling import SamplingParams
from specserve.server import ServerSettings
from tests.conftest import dummy_model_dir

MODEL = "tiny"


def test_replica_metrics_are_labelled_and_merged_into_one_exposition():
    text = ('# HELP specserve:hits Hits.\n# TYPE specserve:hits counter\nspecserve:hits 3\n'
            '# HELP specserve:done Done.\n# TYPE specserve:done counter\nspecserve:done{reason="stop"} 1\n')
    merged = merge_expositions([label_samples(text, "replica", "a"), label_samples(text, "replica", "b")])
    assert merged.splitlines() == [
        "# HELP specserve:hits Hits.", "# TYPE specserve:hits counter",
        'specserve:hits{replica="a"} 3', 'specserve:hits{replica="b"} 3',
        "# HELP specserve:done Done.", "# TYPE specserve:done counter",
        'specserve:done{replica="a",reason="stop"} 1', 'specserve:done{replica="b",reason="stop"} 1']


def test_the_router_sees_a_shared_token_prefix_as_a_shared_string_prefix():
    params = SamplingParams()
    a, b = ReplicaCall("a", [5, 6, 7, 900], params), ReplicaCall("b", [5, 6, 7, 901, 3], params)
    assert len(os.path.commonprefix([a.prompt, b.prompt])) == 3


@pytest.fixture(scope="module")
def ingress(tmp_path_factory) -> tuple[str, Path]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from specserve.replicas import PROXY_READY_TIMEOUT_S, build_app

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_TIMEOUT_S)
    model = dummy_model_dir(tmp_path_factory.mktemp("replicas") / "dummy")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # one per replica: the ingress takes none
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"target": str(model), "load_format": "dummy", "device": "cpu", "dtype": "float32",
                  "kv_cache_memory": "8MiB", "draft": "ngram", "speculation": "fixed"}  # fixed: no calibration
        serve.run(build_app(engine, ServerSettings(model_name=MODEL), replicas=2), name="specserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}", model
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_openai_sdk_streams_completions_through_the_ingress(ingress):
    import openai

    ingress, _ = ingress
    client = openai.OpenAI(base_url=f"{ingress}/v1", api_key="unused", max_retries=0)
    prompt = "Tell me about replicas."
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 2, "tokens arrive as they are made, not in one piece"
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == streamed
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # the server's checks, at the ingress
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=10**6)


def test_requests_sharing_a_long_prefix_land_on_one_replica(ingress):
    import openai

    from specserve.detokenizer import load_tokenizer
    from specserve.models.config import ModelConfig

    ingress, model = ingress
    client = openai.OpenAI(base_url=f"{ingress}/v1", api_key="unused", max_retries=0)
    assert len(_replicas(ingress)) == 2, "both replicas answer /metrics"
    before = _per_replica(ingress)
    document = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 10
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"{document}Question {i}: why?", max_tokens=4, temperature=0)
    after = _per_replica(ingress)
    requests = {r: after["requests"][r] - before["requests"][r] for r in after["requests"]}
    hits = {r: after["hits"][r] - before["hits"][r] for r in after["hits"]}
    (served, count), = [(r, n) for r, n in requests.items() if n]
    assert count == 6, f"every request went to replica {served}: {requests}"
    shared = len(load_tokenizer(model, ModelConfig.from_dir(model)).encode(document))
    assert hits[served] >= 5 * (shared // 16 - 1) * 16, f"the replica's prefix cache served the document: {hits}"
    assert sum(h for r, h in hits.items() if r != served) == 0


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(ingress):
    import openai

    ingress, _ = ingress
    client = openai.OpenAI(base_url=f"{ingress}/v1", api_key="unused", max_retries=0)
    aborted = _finished(ingress, "abort")
    # one token a step (no speculation), as long as the model allows: still going when the client leaves
    stream = client.completions.create(model=MODEL, prompt="Go on and on.", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True, "speculation": {"enabled": False}})
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while _finished(ingress, "abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _finished(ingress, "abort") == aborted + 1
    usage = re.findall(r'^specserve:kv_cache_usage_perc\{replica="[^"]+"\} (\S+)$',
                       httpx.get(f"{ingress}/metrics", timeout=60).text, re.M)
    assert [float(u) for u in usage] == [0.0, 0.0], "its KV blocks are free again"


def _finished(ingress: str, reason: str) -> int:
    text = httpx.get(f"{ingress}/metrics", timeout=60).text
    return sum(int(float(v)) for v in re.findall(
        rf'^specserve:request_success_total\{{replica="[^"]+",finished_reason="{reason}"\}} (\S+)$', text, re.M))


def _replicas(ingress: str) -> set[str]:
    return set(re.findall(r'replica="([^"]+)"', httpx.get(f"{ingress}/metrics", timeout=60).text))


def _per_replica(ingress: str) -> dict[str, Counter]:
    text = httpx.get(f"{ingress}/metrics", timeout=60).text
    out = {"requests": Counter(), "hits": Counter()}
    for replica, value in re.findall(r'^specserve:request_success_total\{replica="([^"]+)",[^}]*\} (\S+)$', text, re.M):
        out["requests"][replica] += int(float(value))
    for replica, value in re.findall(r'^specserve:prefix_cache_hits\{replica="([^"]+)"\} (\S+)$', text, re.M):
        out["hits"][replica] += int(float(value))
    return out



