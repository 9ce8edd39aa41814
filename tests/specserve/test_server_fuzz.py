"""The server under schemathesis: requests generated from its own OpenAPI document, every answer
checked against that document. No 5xx, no status, content type, header or body the document does
not declare; afterwards the engine still answers a greedy request exactly as before.

The model is the tiny random Llama with SmolLM2's tokenizer, with a 64-token context so that
no generated request (up to 64 prompts x 16 samples) takes long."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specserve.async_engine import AsyncEngine
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.server import ServerSettings, create_app

MODEL = "tiny-chat"
GREEDY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
EXAMPLES = 150  # per generation route: 300 in all, about two minutes on two cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


def greedy_text(app) -> str:
    async def ask() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            response = await client.post("/v1/completions", json=GREEDY)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

    return asyncio.run(ask())


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    engine = AsyncEngine(LLMEngine(tiny_chat_model, dtype="float32", config=EngineConfig(
        draft="ngram", kv_cache_memory="16MiB", max_model_len=64)))
    app = create_app(engine, ServerSettings(model_name=MODEL, max_queued_requests=16))
    yield app, engine, greedy_text(app)
    engine.shutdown()


def operations(app) -> list:
    """Every route of the app's OpenAPI document, as schemathesis operations."""
    return [result.ok() for result in schemathesis.openapi.from_asgi("/openapi.json", app).get_all_operations()]


# Without schemathesis' pytest plugin (it does not run under pytest 9): one hypothesis run per route.
@pytest.mark.parametrize("route", ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                   "GET /health", "GET /metrics"])
def test_every_generated_request_gets_an_answer_the_document_declares(served, route):
    (operation,) = [op for op in operations(served[0]) if f"{op.method.upper()} {op.path}" == route]
    examples = EXAMPLES if route.startswith("POST") else 5

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def call(case) -> None:
        case.call_and_validate(checks=CHECKS)

    call()


def test_after_the_fuzzing_the_engine_serves_as_before_and_holds_no_block(served):
    app, engine, before = served
    assert engine.error is None
    assert greedy_text(app) == before
    manager = engine.engine.block_manager
    assert engine.num_unfinished == 0
    engine.engine.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
