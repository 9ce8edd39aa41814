"""`specserve serve`: a real uvicorn server on a loopback port, driven by the official `openai`
SDK (sync and async) and, for every error case, by raw HTTP.

The model is a tiny random Llama with SmolLM2's tokenizer and chat template: its text is noise,
but greedy noise is deterministic, which is all these tests compare."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from specserve.async_engine import AsyncEngine
from specserve.config import DEFAULT_MAX_BODY_BYTES, EngineConfig
from specserve.engine import LLMEngine
from specserve.machine import free_port
from specserve.server import ServerSettings, create_app

MODEL = "tiny-chat"




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
    spec = usage["speculation"]
    assert set(spec) == {"target_forwards", "verify_forwards", "drafted_tokens", "accepted_tokens"}
    # every forward the request took part in counts (its prompt's, its decodes', its trees'), and
    # each emits at most one token besides the drafted ones it accepts
    assert spec["target_forwards"] >= max(1, spec["verify_forwards"])
    assert usage["completion_tokens"] <= spec["target_forwards"] + spec["accepted_tokens"]


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
    for name in ("num_requests_running", "num_requests_waiting", "num_preemptions_total", "kv_cache_usage_perc",
                 "prefix_cache_queries", "prefix_cache_hits", "generation_tokens_total",
                 "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_sum", "spec_decode_num_drafts",
                 "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "kv_cache_blocks",
                 "kv_cache_bytes_per_token"):
        assert f"specserve:{name}" in text
    assert "# TYPE specserve:time_to_first_token_seconds histogram" in text
    # what runs: the tiny model's plain fp32 weights, our fp32 attention kernel, its drafter
    info = next(line for line in text.splitlines() if line.startswith("specserve:engine_info{"))
    assert 'dtype="float32"' in info and 'weights="plain float32"' in info and 'drafter="ngram"' in info
    assert 'kv_cache_dtype="float32"' in info
    assert 'kernels="specserve-cpu ' in info and 'cpu="' in info and info.endswith("} 1")


def test_metrics_show_what_a_drafter_holds_and_requests_may_keep_their_output_to_themselves(server):
    def cached() -> float:
        return metric(server, 'drafter_suffix_cache_tokens{drafter="suffix"}')

    before = cached()
    for share in (False, True):
        server.client().completions.create(model=MODEL, prompt="Suffix", temperature=0, max_tokens=8, extra_body={
            "ignore_eos": True, "speculation": {"drafter": "suffix", "share_output": share}})
        assert cached() == before + 8 * share  # the shared output's tokens, not the private one's


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


def test_a_full_queue_answers_429_instead_of_queueing_for_ever(server):
    server.settings.max_queued_requests = 0
    try:
        message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}), 429)
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


@contextlib.contextmanager
def serve_command(model, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`specserve serve` on the tiny model as a process of its own, once /health answers: (it, its URL)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model), "--dtype", "float32",
         "--kv-cache-memory", "32MiB", "--port", str(port), "--served-model-name", MODEL, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, timeout=120), process.stdout.read() if process.poll() is not None else "not up"
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()


def test_specserve_serve_answers_then_exits_cleanly_on_sigterm(tiny_chat_model):
    with serve_command(tiny_chat_model, "--log-level", "warning") as (process, url):
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


def test_a_drain_that_runs_out_cuts_the_streams_and_exits_0_without_a_traceback(tiny_chat_model):
    with serve_command(tiny_chat_model, "--drain-seconds", "1") as (process, url):
        body = {"model": MODEL, "prompt": "Endless", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        lines = []
        # The server cuts this stream when the drain runs out, mid-chunk or between chunks.
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                                timeout=60) as response:
            for line in response.iter_lines():
                if not lines:
                    process.send_signal(signal.SIGTERM)
                lines.append(line)
        assert "data: [DONE]" not in lines  # cut short by the drain's end, not finished
        assert process.wait(timeout=60) == 0
        log = process.stdout.read()
        assert "Traceback" not in log and "Event loop is closed" not in log, log


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


# -- one request never stops the engine ----------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("top_p", 5e-324), ("top_p", 1e-46), ("top_p", 1e-50),
                                          ("temperature", 1e-320), ("temperature", 1e-39)])
def test_sampling_values_that_underflow_float32_are_served_and_the_engine_stays_up(server, field, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True, field: value}
    out = post(server, "/v1/completions", body)
    assert out.status_code == 200, out.text
    # A temperature below 1e-5 is greedy (as vLLM has it); a top_p that rounds to zero keeps the likeliest token.
    greedy = post(server, "/v1/completions", {**body, field: 1.0, "temperature": 0}).json()
    assert out.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_repetition_penalty_that_would_overflow_is_refused_naming_its_bounds(server):
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "repetition_penalty": 1e-320}),
                       400)
    assert "repetition_penalty" in message and "0.01" in message
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_request_the_engine_fails_gets_a_500_naming_the_cause_and_the_others_go_on(server, failing_sampling):
    failing_sampling(666, "this row is cursed")
    expected = server.client().completions.create(model=MODEL, prompt="Fine", **GREEDY).choices[0].text

    async def run() -> tuple[list[httpx.Response], list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            doomed = [client.post("/v1/completions", json={"model": MODEL, "prompt": "Doomed", "max_tokens": 8,
                                                           "temperature": 0.7, "seed": 666, "stream": stream})
                      for stream in (False, True)]
            fine = [client.post("/v1/completions", json={"model": MODEL, "prompt": "Fine", **GREEDY})
                    for _ in range(4)]
            *failed, = await asyncio.gather(*doomed)
            served = await asyncio.gather(*fine)
            return failed, [r.json()["choices"][0]["text"] for r in served]

    (plain, stream), texts = asyncio.run(run())
    assert "cursed" in error_of(plain, 500)
    assert stream.status_code in (200, 500)  # the error may come before the stream starts or as its last event
    if stream.status_code == 200:
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert "cursed" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    else:
        assert "cursed" in error_of(stream, 500)
    assert texts == [expected] * 4
    assert metric(server, "request_failure_total") >= 2
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert wait_until(server.blocks_all_free)


# -- bounded state, admission, the event loop -----------------------------------------------------------


def test_drafter_specs_are_normalised_and_bounded(server):
    engine = server.engine.engine
    before = set(engine._drafters)
    for spaces in range(40):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "speculation": {"drafter": " NGram" + " " * spaces}}
        assert post(server, "/v1/completions", body).status_code == 200
    assert set(engine._drafters) <= before | {"ngram", "none"}
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                        "speculation": {"drafter": "ngram" + " " * 300}}), 400)
    assert "speculation.drafter" in message and "256" in message


def test_the_queue_limit_holds_exactly_under_a_simultaneous_burst(server):
    assert wait_until(server.blocks_all_free)
    server.settings.max_queued_requests = 8
    body = {"model": MODEL, "prompt": "Burst", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    try:
        for stream in (False, True):
            async def burst(stream=stream) -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                    return await asyncio.gather(*(client.post("/v1/completions", json={**body, "stream": stream})
                                                  for _ in range(40)))

            responses = asyncio.run(burst())
            statuses = sorted(r.status_code for r in responses)
            assert statuses == [200] * 8 + [429] * 32, statuses
            refused = next(r for r in responses if r.status_code == 429)
            assert refused.headers["retry-after"] == "1" and "retry later" in error_of(refused, 429)
            assert all(r.text.rstrip().endswith("data: [DONE]") for r in responses if r.status_code == 200 and stream)
            assert wait_until(server.blocks_all_free)
    finally:
        server.settings.max_queued_requests = 256


def test_tokenizing_does_not_hold_up_the_event_loop(server, monkeypatch):
    engine = server.engine.engine
    real = engine.encode

    def slow_encode(prompt: str, chat: bool = False) -> list[int]:
        time.sleep(1.5)  # a tokenizer busy with megabytes of text
        return real(prompt, chat)

    monkeypatch.setattr(engine, "encode", slow_encode)
    slow = threading.Thread(target=post, args=(server, "/v1/completions", {"model": MODEL, "prompt": "Hi"}))
    slow.start()
    time.sleep(0.2)
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert time.monotonic() - start < 0.5
    slow.join()


def test_a_prompt_of_megabytes_is_refused_before_it_is_tokenized(server):
    server.settings.max_body_bytes = 8 * 2**20
    try:
        start = time.monotonic()
        message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 800_000}), 400)
        assert time.monotonic() - start < 2.0
        assert "maximum context length" in message and "characters" in message
    finally:
        server.settings.max_body_bytes = DEFAULT_MAX_BODY_BYTES


# -- errors in OpenAI's shape, everywhere --------------------------------------------------------------


def test_malformed_bodies_and_values_get_400_in_openai_shape_saying_what_to_change(server):
    surrogate = '{"model": "' + MODEL + '", "prompt": "\\ud800abc"}'
    assert "surrogate" in error_of(post(server, "/v1/completions", surrogate), 400)
    chat = '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "\\ud800abc"}]}'
    assert "surrogate" in error_of(post(server, "/v1/chat/completions", chat), 400)
    assert "UTF-8" in error_of(post(server, "/v1/completions", b'{"model": "x", "prompt": "\xff\xfe"}'), 400)
    nested = '{"model": "' + MODEL + '", "prompt": "x", "user": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert "nested too deeply" in error_of(post(server, "/v1/completions", nested), 400)
    message = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}), 400)
    assert message.startswith("seed:")
    assert "no route" in error_of(httpx.get(f"{server.url}/v2/nothing"), 404)


def test_the_openapi_document_says_what_the_server_does(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "413", "429", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    request = spec["components"]["schemas"]["CompletionRequest"]
    assert request["properties"]["model"]["enum"] == [MODEL]


# -- an engine that cannot go on ------------------------------------------------------------------------


def test_a_dead_engine_is_logged_and_ends_the_server_with_status_1(tiny_chat_model, caplog):
    from specserve.server import DrainingServer, run_server

    def broken_step():
        raise RuntimeError("the KV pool is corrupt")

    engine = AsyncEngine(LLMEngine(tiny_chat_model, dtype="float32", config=EngineConfig(kv_cache_memory="16MiB")))
    port = free_port()
    server = DrainingServer(uvicorn.Config(create_app(engine, ServerSettings(model_name=MODEL)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    exit_code = []
    thread = threading.Thread(target=lambda: exit_code.append(run_server(server, engine)))
    thread.start()
    assert wait_until(lambda: server.started)
    engine.engine.step = broken_step
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert "the KV pool is corrupt" in error_of(response, 503)
    thread.join(timeout=30)
    assert exit_code == [1]
    assert any(r.levelname == "CRITICAL" and r.exc_info for r in caplog.records)


def test_health_says_why_the_engine_stopped(tiny_chat_model):
    def broken_step():
        raise RuntimeError("the KV pool is corrupt")

    engine = AsyncEngine(LLMEngine(tiny_chat_model, dtype="float32", config=EngineConfig(kv_cache_memory="16MiB")))
    engine.engine.step = broken_step
    app = create_app(engine, ServerSettings(model_name=MODEL))

    async def ask() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            request = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
            return request, await client.get("/health")

    request, health = asyncio.run(ask())
    assert "the KV pool is corrupt" in error_of(request, 503)
    assert "the KV pool is corrupt" in error_of(health, 503)
    engine.shutdown()
