"""What a router in front of stoker replicas needs besides the OpenAI routes (docs/fleet.md).

The Shepherd Model Gateway (SMG) identifies an HTTP worker's engine before it routes to it: it
reads `owned_by` from /v1/models (stoker says "stoker", which it does not know), then probes
GET /version (vLLM) and GET /server_info (SGLang). stoker answers /version as vLLM does, since
what SMG then relies on is vLLM's shape, and stoker already has it: /v1/models with `root` and
`max_model_len`, the `vllm:num_requests_running` / `vllm:num_requests_waiting` gauges on /metrics
that its load monitor reads, and /health. /server_info is left out on purpose: a worker that
answers it alone is taken for SGLang, whose load comes from `sglang:*` gauges stoker lacks.
"""

from __future__ import annotations

import importlib.metadata

import msgspec
from starlette.requests import Request
from starlette.responses import Response


def stoker_version() -> str:
    try:
        return importlib.metadata.version("stoker")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


_VERSION = msgspec.json.encode({"version": stoker_version(), "engine": "stoker"})


async def version(request: Request) -> Response:
    """GET /version, vLLM's shape ({"version": ...}); without it SMG registers the worker as a
    `generic` engine and has no load figures for it."""
    return Response(_VERSION, media_type="application/json")
