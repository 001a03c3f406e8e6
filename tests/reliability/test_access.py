"""--api-key on every route, what stays open, and what the server gives away (no paths)."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from stoker.common.addresses import private_dir
from stoker.services.api.guard import ApiKeyMiddleware
from tests.reliability.serve import Served

KEY = "sk-test-5f3a"
GENERATE = {
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
GETS = ["/v1/models", "/debug/state", "/openapi.json", "/metrics"]


@pytest.fixture(scope="module")
def keyed(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    server = Served(
        model, tmp / "run", tmp / "serve.log", "--null-model", "--protect-metrics",
        STOKER_API_KEY=KEY,
    )  # fmt: skip
    yield server
    server.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", f"Bearer {KEY}x", KEY, f"Basic {KEY}", "Bearer"]
)
def test_every_route_needs_the_key(keyed, auth):
    headers = {} if auth is None else {"Authorization": auth}
    for path, body in GENERATE.items():
        err = _error(httpx.post(keyed.url + path, json=body, headers=headers, timeout=10), 401)
        assert err["code"] == "invalid_api_key"
    for path in [*GETS, "/nowhere"]:
        _error(httpx.get(keyed.url + path, headers=headers, timeout=10), 401)


def test_the_key_opens_every_route_and_health_stays_open(keyed):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200  # no key: probes
    for path, body in GENERATE.items():
        r = httpx.post(keyed.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    for path in GETS:
        assert httpx.get(keyed.url + path, headers=headers, timeout=10).status_code == 200
    doc = httpx.get(f"{keyed.url}/openapi.json", headers=headers, timeout=10).json()
    assert doc["security"] == [{"bearer": []}]
    s = keyed.wait_blocks_free(headers=headers)
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_key_is_not_on_any_command_line(keyed):
    for pid in keyed.children + [keyed.proc.pid]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()


def test_metrics_open_without_protect_metrics():
    """Unit: the middleware's open paths."""

    async def app(scope, receive, send):  # pragma: no cover - never reached when refused
        raise AssertionError

    guard = ApiKeyMiddleware(app, KEY)
    assert guard._open == {"/health", "/metrics"}
    assert ApiKeyMiddleware(app, KEY, protect_metrics=True)._open == {"/health"}
    assert guard.authorized([(b"authorization", f"Bearer {KEY}".encode())])
    assert not guard.authorized([(b"authorization", f"Bearer {KEY[:-1]}".encode())])
    assert not guard.authorized([])


def test_no_filesystem_paths_in_models_or_state(fuzz_server):
    for path in ("/v1/models", "/debug/state"):
        text = httpx.get(fuzz_server.url + path, timeout=10).text
        assert str(fuzz_server.model) not in text and str(fuzz_server.model.parent) not in text
        assert "/tmp" not in text and "ipc://" not in text, text


def test_run_dir_is_private(tmp_path):
    d = private_dir(tmp_path / "new" / "run")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(PermissionError, match="open to other users"):
        private_dir(loose)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(PermissionError, match="not a directory"):
        private_dir(link)


def test_binds_loopback_by_default():
    from stoker.launcher import build_parser

    assert build_parser().parse_args([]).host == "127.0.0.1"
