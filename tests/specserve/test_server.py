"""`specserve serve`: a real uvicorn server on a loopback port, driven by the official `openai`
SDK (sync and async) and, for every error case, by raw HTTP.

The model is a tiny random Llama with SmolLM2's tokenizer and chat template: its text is noise,
but greedy noise is deterministic, which is all these tests compare."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from specserve.async_engine import AsyncEngine
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.server import ServerSettings, create_app

MODEL = "tiny-chat"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(engine, settings), host="127.0.0.1",
                                                     port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), **kwargs)

    def blocks_all_free(self) -> bool:
        manager = self.engine.engine.block_manager
        return self.engine.num_unfinished == 0 and manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    engine = AsyncEngine(LLMEngine(tiny_chat_model, dtype="float32",
                                   config=EngineConfig(draft="ngram", kv_cache_memory="64MiB")))
    with Server(engine, ServerSettings(model_name=MODEL)) as running:
        yield running
    engine.shutdown()


@pytest.fixture
def aborted(server, monkeypatch) -> list[int]:
    """Tokens each request aborted while running had generated (the engine's aborts, spied on)."""
    engine, counts = server.engine.engine, []

    def abort(request_id: str):
        out = LLMEngine.abort(engine, request_id)
        if out is not None:
            counts.append(max(len(c.token_ids) for c in out.outputs))
        return out

    monkeypatch.setattr(engine, "abort", abort)
    return counts


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


GREEDY = {"temperature": 0, "max_tokens": 12}


# -- the SDK ----------------------------------------------------------------------------------------


def test_a_completion_reports_its_usage_with_what_speculation_did(server):
    out = server.client().completions.create(model=MODEL, prompt="The capital of France is", **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    usage = out.usage.model_dump()
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert set(usage["speculation"]) == {"target_forwards", "drafted_tokens", "accepted_tokens"}


def test_streamed_text_assembled_from_chunks_equals_the_non_streamed_text(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason is not None

    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_n_samples_and_a_seed_reproduce(server):
    client = server.client()
    params = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    first = client.completions.create(**params)
    assert sorted(c.index for c in first.choices) == [0, 1]
    again = client.completions.create(**params)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(first.choices, key=lambda c: c.index)]


def test_a_prompt_batch_gets_one_choice_per_prompt_in_order(server):
    client = server.client()
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in ("A", "B")]
    batch = client.completions.create(model=MODEL, prompt=["A", "B"], **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone


def test_a_stop_string_ends_the_text_before_it(server):
    client = server.client()
    text = client.completions.create(model=MODEL, prompt="Count:", temperature=0, max_tokens=24).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "the greedy text is too short to pick a stop string from"
    out = client.completions.create(model=MODEL, prompt="Count:", temperature=0, max_tokens=24, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


def test_logprobs_come_with_each_token(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="Hi", logprobs=3, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == out.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs) and all(len(t) == 3 for t in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_echo_puts_the_prompt_before_the_completion(server):
    out = server.client().completions.create(model=MODEL, prompt="Echo this", echo=True, **GREEDY)
    assert out.choices[0].text.startswith("Echo this")


def concurrent_texts(server, prompt: str, clients: int) -> list[str]:
    """The greedy completion of `prompt` asked by `clients` async SDK requests at once."""
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
                                      for _ in range(clients)))
        await client.close()
        return [o.choices[0].text for o in outs]

    return asyncio.run(run())


def test_the_async_client_gets_what_the_sync_client_gets(server):
    sync = server.client().completions.create(model=MODEL, prompt="Async", **GREEDY).choices[0].text
    assert concurrent_texts(server, "Async", 4) == [sync] * 4


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def metric(server, name: str) -> float:
    """A sample's value from /metrics (`name` with its labels, as exposed)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f"specserve:{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_latencies_and_speculation_in_prometheus_format(server):
    before = metric(server, "time_to_first_token_seconds_count")
    ended = metric(server, 'request_success_total{finished_reason="length"}')
    server.client().completions.create(model=MODEL, prompt="Metrics", temperature=0, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert metric(server, "time_to_first_token_seconds_count") == before + 1
    assert metric(server, 'request_success_total{finished_reason="length"}') == ended + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "generation_tokens_total", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_sum", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        assert f"specserve:{name}" in text
    assert "# TYPE specserve:time_to_first_token_seconds histogram" in text


# -- errors, by raw HTTP ----------------------------------------------------------------------------


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json",
                                                                         **kwargs.pop("headers", {})}, **kwargs)


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


def test_bad_requests_get_400_saying_what_to_change(server):
    assert "not valid JSON" in error_of(post(server, "/v1/completions", b"{not json"), 400)
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400)
    assert "max_tokens" in message
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}), 400)
    assert "temperature" in message
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}), 400)
    assert "top_p" in message
    message = error_of(post(server, "/v1/completions", {"model": "gpt-17", "prompt": "x"}), 400)
    assert "gpt-17" in message and MODEL in message
    message = error_of(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    assert "messages" in message
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [10**9]}), 400)
    assert "vocabulary" in message
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                        "speculation": {"drafter": "no-such-thing"}}), 400)
    assert "no-such-thing" in message


def test_a_prompt_longer_than_the_context_gets_the_limit_and_its_length(server):
    limit = server.engine.engine.max_model_len
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * (limit + 3)}), 400)
    assert message.startswith(f"This model's maximum context length is {limit} tokens; your prompt has {limit + 3}")
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 10,
                                                        "max_tokens": limit}), 400)
    assert f"lower max_tokens to at most {limit - 10}" in message
    # Streaming or not, the error comes before any stream starts.
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * (limit + 3), "stream": True})
    assert response.status_code == 400


def test_an_api_key_is_required_when_set(server):
    server.settings.api_key = "sekrit"
    try:
        assert "API key" in error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}), 401)
        wrong = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="no").models.list()
        assert server.client(api_key="sekrit").models.list().data[0].id == MODEL
        assert httpx.get(f"{server.url}/health").status_code == 200  # open to probes
        assert httpx.get(f"{server.url}/metrics").status_code == 200  # and scrapers
    finally:
        server.settings.api_key = None


def test_a_body_over_the_limit_is_refused(server):
    prompt = "x" * (server.settings.max_body_bytes + 10)
    assert "exceeds" in error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": prompt}), 413)


def test_a_full_queue_answers_503_instead_of_queueing_for_ever(server):
    server.settings.max_queued_requests = 0
    try:
        message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}), 503)
        assert "retry" in message
    finally:
        server.settings.max_queued_requests = 256


# -- clients that go away ----------------------------------------------------------------------------


def test_twenty_streams_dropped_mid_stream_give_back_all_their_blocks(server, aborted):
    assert wait_until(server.blocks_all_free)
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": True})

    def drop_after_first_chunk() -> None:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{server.url}/v1/completions", content=body,
                headers={"Content-Type": "application/json"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    return  # leaving the block closes the connection mid-stream

    aborts = metric(server, 'request_success_total{finished_reason="abort"}')
    threads = [threading.Thread(target=drop_after_first_chunk) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wait_until(server.blocks_all_free), (server.engine.num_unfinished,
                                                server.engine.engine.block_manager.num_free_blocks)
    assert len(aborted) == 20 and max(aborted) < 1500  # stopped by the disconnects, not by max_tokens
    assert metric(server, 'request_success_total{finished_reason="abort"}') == aborts + 20


def test_a_non_streaming_client_that_goes_away_aborts_its_request(server, aborted):
    assert wait_until(server.blocks_all_free)
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=0.3)
    assert wait_until(server.blocks_all_free)
    assert len(aborted) == 1 and aborted[0] < 1500


def test_thirty_two_concurrent_clients_all_get_complete_answers(server):
    expected = server.client().completions.create(model=MODEL, prompt="Many", **GREEDY).choices[0].text
    assert concurrent_texts(server, "Many", 32) == [expected] * 32


# -- the command ------------------------------------------------------------------------------------


def test_specserve_serve_answers_then_exits_cleanly_on_sigterm(tiny_chat_model):
    import signal
    import subprocess
    import sys

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--target", str(tiny_chat_model), "--dtype", "float32",
         "--kv-cache-memory", "32MiB", "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, timeout=120), process.stdout.read() if process.poll() is not None else "not up"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert client.completions.create(model=MODEL, prompt="Hi", **GREEDY).choices[0].text
        # SIGTERM mid-stream: the stream in flight still runs to its end, then the process exits 0.
        body = {"model": MODEL, "prompt": "Drain", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        finishes, done = [], False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if process.poll() is None and not finishes:
                        process.send_signal(signal.SIGTERM)
                    finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                done = done or line == "data: [DONE]"
        assert done and finishes[-1] == "length"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_the_embedded_default_serves_with_its_own_drafter_unless_told_otherwise():
    from specserve.cli import build_parser, serve_settings

    assert serve_settings(build_parser().parse_args(["serve"]))["draft"] == "ngram"
    assert serve_settings(build_parser().parse_args(["serve", "--draft", "none"]))["draft"] == "none"
    assert "draft" not in serve_settings(build_parser().parse_args(["serve", "--target", "/some/dir"]))


def test_every_engine_setting_is_a_flag_checked_before_anything_loads(capsys):
    from specserve.cli import build_parser, engine_settings, main

    args = build_parser().parse_args(["serve", "--block-size", "32", "--max-num-seqs", "8",
                                      "--max-num-batched-tokens", "256", "--max-model-len", "1024",
                                      "--no-prefix-caching", "--max-tree-tokens", "4"])
    settings = engine_settings(args)
    assert {k: settings[k] for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                     "enable_prefix_caching", "max_tree_tokens")} == {
        "block_size": 32, "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 1024,
        "enable_prefix_caching": False, "max_tree_tokens": 4}
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be at least 1" in capsys.readouterr().err
