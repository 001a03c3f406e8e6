"""GET /dashboard in a real headless Chromium (Debian's, driven by playwright) over a real
`stoker serve` with two tokenizers, n-gram speculation, --api-key and --protect-metrics: the
page is served without the key, asks for the key /metrics needs (or reads it from #key=...),
raises no console or page error, and its charts move under real traffic from the openai client.
Its Prometheus-text parser is checked in the browser against prometheus_client's own parser.

scripts/setup.sh installs chromium; without it (a machine where setup could not run apt) the
browser tests are skipped and say why. The page's assembly is checked without a browser.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from stoker.services.api.dashboard_routes import render_page
from tests.factory import make_model
from tests.reliability.serve import Served

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"{CHROMIUM} is missing (scripts/setup.sh installs it)"
)

# What the probe on these machines found headless Chromium needs (no sandbox as root in a
# container, no GPU, nothing reaching out to the network).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
KEY = "dash-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ["--num-kv-blocks", "128", "--max-model-len", "256", "--tokenizers", "2",
         "--speculative", "ngram", "--num-speculative-tokens", "2",
         "--api-key", KEY, "--protect-metrics"]  # fmt: skip
# Series that must move from zero under traffic; the api-side ones are zero before it (the
# step histograms may still hold the worker's warm-up).
REQUEST_SERIES = ["out_tok_s", "req_s", "prompt_tok_s", "ttft_p50", "itl_p50",
                  "tokenizer:tok-0", "tokenizer:tok-1"]  # fmt: skip
MOVED = [*REQUEST_SERIES, "step_worker_forward", "step_schedule", "running", "kv_usage"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    s = Served(make_model(tmp / "m", "llama"), tmp / "run", tmp / "serve.log", *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1000},
        )  # fmt: skip
        yield context
        context.close()


class Page:
    """A new tab that records every console message and uncaught error."""

    def __init__(self, context, url: str) -> None:
        self.page = context.new_page()
        self.console: list[str] = []
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def state(self) -> dict:
        return self.page.evaluate("window.stokerDashboard")

    def wait(self, expression: str, timeout_s: float = 30) -> None:
        # Polled from here: wait_for_function evals a string in the page, which the page's
        # Content-Security-Policy (rightly) refuses; evaluate goes through DevTools instead.
        deadline = time.monotonic() + timeout_s
        while not self.page.evaluate(f"() => Boolean(window.stokerDashboard && {expression})"):
            assert time.monotonic() < deadline, f"{expression}: {self.problems()} {self.state()}"
            time.sleep(0.1)

    def problems(self) -> list[str]:
        return self.errors + [m for m in self.console if m.startswith(("error", "warning"))]


def test_page_inlines_its_assets_under_a_hash_csp() -> None:
    html, csp = render_page()
    page = html.decode()
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    styles = re.findall(r"<style>(.*?)</style>", page, re.S)
    assert len(scripts) == 3 and len(styles) == 1  # metrics.js, charts.js, dashboard.js; the css
    for body in scripts + styles:
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert "data-inline" not in page and "unsafe" not in csp and "connect-src 'self'" in csp
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # nothing else to load
    assert "http://" not in page and "https://" not in page


@needs_chromium
def test_page_is_served_without_the_key_and_asks_for_it(served, browser) -> None:
    r = httpx.get(f"{served.url}/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert httpx.get(f"{served.url}/metrics").status_code == 401  # --protect-metrics
    assert httpx.post(f"{served.url}/dashboard").status_code == 405

    tab = Page(browser, f"{served.url}/dashboard?interval=300")
    tab.wait("window.stokerDashboard.status === 'locked'")
    assert tab.page.is_visible("#key-form")
    # The one 401 Chromium reports for the unauthenticated scrape is expected; nothing else.
    refused = [m for m in tab.console if "401" in m]
    assert len(refused) == 1, tab.console
    assert [p for p in tab.problems() if "401" not in p] == []
    tab.page.fill("#key-input", KEY)
    tab.page.click("#key-form button")
    tab.wait("window.stokerDashboard.status === 'live' && window.stokerDashboard.scrapes >= 2")
    assert not tab.page.is_visible("#key-form")
    tab.page.close()


def _rows(samples: list) -> list[tuple[str, list, float]]:
    return sorted((name, sorted(labels.items()), float(value)) for name, labels, value in samples)


@needs_chromium
def test_parser_agrees_with_prometheus_client(served, browser) -> None:
    tab = Page(browser, f"{served.url}/dashboard?interval=60000#key={KEY}")
    tab.wait("window.stokerDashboard.scrapes >= 1")
    text = httpx.get(f"{served.url}/metrics", headers=AUTH).text
    ours = tab.page.evaluate(
        """text => [...StokerMetrics.parse(text).samples].flatMap(([name, rows]) =>
             rows.map(r => [name, r.labels, String(r.value)]))""",
        text,
    )
    theirs = [
        [s.name, s.labels, str(s.value)]
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    ours, theirs = _rows(ours), _rows(theirs)
    assert [r[:2] for r in ours] == [r[:2] for r in theirs] and len(ours) > 100
    for (name, labels, a), (_, _, b) in zip(ours, theirs):
        assert math.isclose(a, b) or (math.isnan(a) and math.isnan(b)), (name, labels, a, b)

    # The format's corners, and histogram_quantile's rules, on made-up input.
    got = tab.page.evaluate(
        r"""() => {
          const M = StokerMetrics;
          const s = M.parse([
            '# HELP x_total a "help" line',
            '# TYPE x_total counter',
            'x_total{path="/a\\"b\\\\c\\nd",code="200"} 3 1700000000000',
            'x_total{code="500"} 1.5e1',
            'g NaN', 'h_bucket{le="0.1"} 2', 'h_bucket{le="0.2"} 6', 'h_bucket{le="+Inf"} 8',
          ].join('\n'));
          const b = M.buckets(s, 'h');
          return {
            label: s.samples.get('x_total')[0].labels.path,
            sum: M.value(s, 'x_total'), only500: M.value(s, 'x_total', {code: '500'}),
            missing: M.value(s, 'nope') === undefined, nan: Number.isNaN(M.value(s, 'g')),
            type: s.types.get('x_total'),
            p50: M.quantile(0.5, b), p90: M.quantile(0.9, b), p0: M.quantile(0, b),
            empty: Number.isNaN(M.quantile(0.5, [[0.1, 0], [Infinity, 0]])),
            delta: M.bucketDelta([[0.1, 1], [0.2, 2], [Infinity, 2]], b),
            reset: M.bucketDelta([[0.1, 5], [0.2, 9], [Infinity, 9]], b),
            rate: M.rate(10, 16, 2), rateAfterReset: M.rate(10, 4, 2),
            bad: (() => { try { M.parse('x 1two'); return false; } catch (e) { return true; } })(),
          };
        }"""
    )
    assert got["label"] == '/a"b\\c\nd'
    assert (got["sum"], got["only500"], got["type"]) == (18, 15, "counter")
    assert got["missing"] and got["nan"] and got["empty"] and got["bad"]
    assert math.isclose(got["p50"], 0.15) and got["p90"] == 0.2 and got["p0"] == 0
    inf = float("inf")
    assert got["delta"] == [[0.1, 1], [0.2, 4], [inf, 6]]
    assert got["reset"] == [[0.1, 2], [0.2, 6], [inf, 8]]  # counts went down: from zero
    assert (got["rate"], got["rateAfterReset"]) == (3, 2)
    assert tab.problems() == []
    tab.page.close()


def _traffic(url: str, stop: threading.Event, worker: int) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    i = 0
    while not stop.is_set():
        prompt = f"To be, or not to be, that is the question {worker} {i}"
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        for _ in stream:
            pass
        i += 1


@needs_chromium
def test_charts_move_under_traffic(served, browser, tmp_path) -> None:
    tab = Page(browser, f"{served.url}/dashboard?interval=250&window=2#key={KEY}")
    assert "key=" not in tab.page.url  # taken out of the address bar
    tab.wait("window.stokerDashboard.scrapes >= 3")
    idle = tab.state()["latest"]
    assert not [k for k in REQUEST_SERIES if idle.get(k, 0) > 0], idle  # nothing has run yet
    before = tab.page.evaluate("document.getElementById('chart-tokens').toDataURL()")

    stop = threading.Event()
    threads = [threading.Thread(target=_traffic, args=(served.url, stop, w)) for w in range(3)]
    for t in threads:
        t.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 40
    try:
        while not set(MOVED) <= seen and time.monotonic() < deadline:
            latest = tab.state()["latest"]
            seen |= {k for k, v in latest.items() if isinstance(v, (int, float)) and v > 0}
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert set(MOVED) <= seen, sorted(set(MOVED) - seen)
    state = tab.state()
    assert state["spec"] and state["tokenizers"] == ["tok-0", "tok-1"]
    assert state["errors"] == 0 and state["status"] == "live"
    assert tab.page.evaluate("document.getElementById('chart-tokens').toDataURL()") != before
    legend = tab.page.inner_text("#legend-ttft")
    assert "p99" in legend and "ms" in legend, legend
    shot = Path(os.environ.get("STOKER_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    tab.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert tab.problems() == []
    tab.page.close()
    served.wait_blocks_free(headers=AUTH)
    stats = served.state(AUTH)["scheduler"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
