"""`/openapi.json`: FastAPI's description of the routes, corrected to what the server really does.

FastAPI documents 422 for invalid bodies (the server sends 400 in OpenAI's error shape),
leaves `model` a free string (only the served name is accepted), knows nothing of streaming
responses, and omits the statuses the guard and the handlers send (401, 413, 429, 500, 503). A
fuzzer (schemathesis, `tests/specserve/test_server_fuzz.py`) holds the server to this.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

NULLABLE_STRING = {"type": ["string", "null"]}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": NULLABLE_STRING,
                       "code": NULLABLE_STRING}}},
}
USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                   "total_tokens": {"type": "integer"},
                   "speculation": {"type": "object", "properties": {
                       "target_forwards": {"type": "integer"}, "verify_forwards": {"type": "integer"},
                       "drafted_tokens": {"type": "integer"}, "accepted_tokens": {"type": "integer"}}}},
}
FINISH_REASON = {"enum": ["stop", "length", "abort", None]}


def _completion(kind: str, choice: dict) -> dict:
    """A (chat) completion object: `choice` the properties of a choice besides index, logprobs
    and finish_reason."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": USAGE,
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", *choice, "logprobs", "finish_reason"],
                "properties": {"index": {"type": "integer"}, **choice, "logprobs": {"type": ["object", "null"]},
                               "finish_reason": FINISH_REASON}}},
        },
    }


COMPLETION = _completion("text_completion", {"text": {"type": "string"}})
CHAT_COMPLETION = _completion("chat.completion", {"message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}})
MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {"type": "object", "required": ["id", "object", "owned_by"],
                                        "properties": {"id": {"type": "string"}}}}}}
HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
# One server-sent event: `data: <chunk JSON>` per chunk, an error event if the engine fails the
# request mid-stream, then `data: [DONE]`.
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk's JSON, an error's JSON, or [DONE]"}}}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str, headers: dict | None = None) -> dict:
    response = _json({"$ref": "#/components/schemas/Error"}, description)
    if headers:
        response["headers"] = headers
    return response


GENERATION_ERRORS = {
    "400": _error("Bad input, with a message saying what to change (OpenAI's shape; never 422)"),
    "401": _error("Missing or wrong API key (when the server has --api-key)"),
    "413": _error("The body exceeds --max-body-bytes"),
    "500": _error("The engine failed this request alone (the others go on); the message names the cause"),
    "429": _error("--max-queued-requests are already queued or running: retry after Retry-After seconds",
                  {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}),
    "503": _error("The engine stopped; the process exits for a supervisor to restart it"),
}


def openapi_schema(app: FastAPI, model_name: str) -> dict[str, Any]:
    """The app's OpenAPI document (built once, then cached on the app as FastAPI does)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title="specserve", version="0.1.0", routes=app.routes,
                         description="OpenAI-compatible, speculative-decoding-first LLM serving.")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"] = ERROR
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        components[name]["properties"]["model"] = {"type": "string", "enum": [model_name],
                                                   "description": "the served model (GET /v1/models)"}
    paths = schema["paths"]
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT_COMPLETION)):
        paths[path]["post"]["responses"] = {
            "200": {"description": "The completion; with `stream: true`, server-sent events",
                    "content": {"application/json": {"schema": body}, **SSE}},
            **GENERATION_ERRORS}
    paths["/v1/models"]["get"]["responses"] = {"200": _json(MODELS, "The served model"),
                                               "401": GENERATION_ERRORS["401"]}
    paths["/health"]["get"]["responses"] = {"200": _json(HEALTH, "The engine is serving"),
                                            "503": _error("The engine stopped; the process exits for a restart")}
    paths["/metrics"]["get"]["responses"] = {"200": {"description": "Prometheus text exposition",
                                                     "content": {"text/plain": {"schema": {"type": "string"}}}}}
    app.openapi_schema = schema
    return schema
