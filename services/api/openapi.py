"""The OpenAPI document at /openapi.json, generated from the same msgspec Structs that decode
the bodies, so the schema and the checks cannot drift apart (the fuzz tests rely on that)."""

from __future__ import annotations

from typing import Any

import msgspec

from stoker.services.api.openai_schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from stoker.services.api.structured_request import REMOVED_GUIDED_FIELDS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
_PROMPT = {
    "anyOf": [
        {"type": "string"},
        _IDS,
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 1},
    ]
}


def _errors(*codes: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": "an OpenAI error body", "content": content} for c in codes}


def _generate_op(name: str, summary: str) -> dict[str, Any]:
    body = {"$ref": f"#/components/schemas/{name}"}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "the completion (JSON), or server-sent events when streaming",
                    "content": {"application/json": {}, "text/event-stream": {}},
                },
                **_errors(400, 401, 404, 413, 503, 504),
            },
        }
    }


def _post_op(body: dict[str, Any], summary: str, response: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": "ok", "content": {"application/json": {"schema": response}}},
                **_errors(400, 401, 404, 413),
            },
        }
    }


_TOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": ["integer", "null"]},
        "tokens": _IDS,
        "token_strs": {"type": "array", "items": {"type": "string"}},
    },
}
_DETOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


_PROFILE_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "num_steps": {"type": ["integer", "null"], "minimum": 1},
        "record_shapes": {"type": "boolean", "default": False},
        "with_stack": {"type": "boolean", "default": False},
    },
}
_PROFILE_RESPONSE = {
    "type": "object",
    "required": ["status", "profile_dir"],
    "properties": {"status": {"type": "string"}, "profile_dir": {"type": "string"}},
}


def _profile_op(summary: str, body: bool) -> dict[str, Any]:
    content = {"application/json": {"schema": _PROFILE_RESPONSE}}
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "ok", "content": content}, **_errors(400, 401, 404)},
    }
    if body:
        schema = {"application/json": {"schema": _PROFILE_REQUEST}}
        op["requestBody"] = {"required": False, "content": schema}
    return {"post": op}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _get_op(summary: str, *errors: int) -> dict[str, Any]:
    responses = {"200": {"description": "ok"}, **_errors(*errors)}
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(limits: Limits, secured: bool) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [
            CompletionRequest,
            ChatRequest,
            TokenizeCompletionRequest,
            TokenizeChatRequest,
            DetokenizeRequest,
        ],
        ref_template="#/components/schemas/{name}",
    )
    components["CompletionRequest"]["properties"]["prompt"] = _PROMPT
    for name in ("CompletionRequest", "ChatRequest"):
        properties = components[name]["properties"]
        # The server's own bound, not int64's; null is 1.
        properties["n"] = {"type": ["integer", "null"], "minimum": 1, "maximum": limits.max_n}
        for field, replacement in REMOVED_GUIDED_FIELDS.items():
            properties[field] = {
                "type": "null",
                "deprecated": True,
                "description": f"vLLM's removed spelling: a 400 unless null; use {replacement}",
            }
    components["Error"] = _ERROR
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "stoker", "version": "1", "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/completions": _generate_op("CompletionRequest", "text completion"),
            "/v1/chat/completions": _generate_op("ChatRequest", "chat completion"),
            "/v1/models": _get_op("the served model", 401),
            "/health": _get_op("200 when every process is up and the engine makes progress", 503),
            "/metrics": _get_op("Prometheus metrics", 401),
            "/debug/state": _get_op("the scheduler's latest numbers", 401),
            "/version": _get_op("stoker's version, in vLLM's shape (routers probe it)", 401),
            "/dashboard": _get_op("the live dashboard page (HTML)"),
            "/tokenize": _post_op(
                {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
                "the ids a prompt (or messages, through the chat template) is served with",
                _TOKENIZE_RESPONSE,
            ),
            "/detokenize": _post_op(
                _ref("DetokenizeRequest"), "token ids -> text", _DETOKENIZE_RESPONSE
            ),
            "/start_profile": _profile_op(
                "start the torch profiler in the worker and scheduler (404 without --profile-dir)",
                body=True,
            ),
            "/stop_profile": _profile_op("stop profiling and write the traces", body=False),
        },
        "components": {"schemas": components},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
