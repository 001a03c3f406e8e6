"""Regenerate tests/clients/payloads.json: the request bodies the real client libraries send by
default, as test_real_clients.py makes them send, captured by its proxy (conftest.py).

    .venv/bin/python tests/clients/capture_payloads.py

runs that module with STOKER_CAPTURE_PAYLOADS set; the proxy fixture writes the bodies at the
end. Call ids (random per response, echoed back by multi-turn clients) become call_0, call_1,
... in order of appearance, so the file changes only when what the clients send changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.clients.conftest import Exchange

ENV = "STOKER_CAPTURE_PAYLOADS"
HERE = Path(__file__).resolve().parent
PAYLOADS = HERE / "payloads.json"


def _rename_ids(value: Any, ids: dict[str, str]) -> Any:
    """Every call id (a tool call's `id`, a tool message's `tool_call_id`) -> call_N."""
    if isinstance(value, list):
        return [_rename_ids(v, ids) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        is_call_id = k == "tool_call_id" or (k == "id" and "function" in value)
        if is_call_id and isinstance(v, str):
            v = ids.setdefault(v, f"call_{len(ids)}")
        out[k] = _rename_ids(v, ids)
    return out


def payloads(exchanges: list[Exchange]) -> dict[str, list[dict]]:
    """The accepted chat-completion bodies, by the label of the call that sent them."""
    out: dict[str, list[dict]] = {}
    for ex in exchanges:
        if ex.method == "POST" and ex.path == "/v1/chat/completions" and ex.status == 200:
            body = _rename_ids(json.loads(ex.body), {})
            out.setdefault(ex.label, []).append(body)
    # Concurrent calls (LangChain's batch) arrive in any order; a loop's turns grow.
    for bodies in out.values():
        bodies.sort(key=lambda b: (len(b.get("messages", ())), json.dumps(b, sort_keys=True)))
    return out


def write(exchanges: list[Exchange], path: Path) -> None:
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in payloads(exchanges).items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def main() -> int:
    test = HERE / "test_real_clients.py"
    cmd = [sys.executable, "-m", "pytest", str(test), "-q", "-k", "not pinned_payloads"]
    root = HERE.parents[1]
    return subprocess.call(cmd, cwd=root, env=dict(os.environ, **{ENV: str(PAYLOADS)}))


if __name__ == "__main__":
    sys.exit(main())
