"""GET /dashboard: one self-contained page that polls /metrics and draws live charts.

Its HTML, CSS and JavaScript ship in the package (services/api/dashboard/) and are inlined into
one response when the app is built, so the page needs nothing but /metrics: no CDN, no second
request. The page holds no data, so it is served ahead of the --api-key check, like /health;
the numbers come from /metrics under its own rule (open, or the key with --protect-metrics, which
the page then asks for or reads from the URL fragment, #key=...).
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

PATHS = ("/dashboard", "/dashboard/")
_INLINE = re.compile(r'<(style|script) data-inline="([\w.-]+)"></\1>')


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def render_page() -> tuple[bytes, str]:
    """The page with its assets inlined, and a Content-Security-Policy that allows exactly
    those inline scripts and styles, and fetches only to this origin."""
    folder = resources.files("stoker.services.api") / "dashboard"
    hashes: dict[str, list[str]] = {"script": [], "style": []}

    def inline(match: re.Match[str]) -> str:
        tag, name = match.group(1), match.group(2)
        body = (folder / name).read_text(encoding="utf-8")
        if f"</{tag}" in body.lower():
            raise ValueError(f"dashboard/{name} contains </{tag}>, which would end the element")
        hashes[tag].append(_digest(body))
        return f"<{tag}>{body}</{tag}>"

    html = _INLINE.sub(inline, (folder / "index.html").read_text(encoding="utf-8"))
    csp = (
        f"default-src 'none'; script-src {' '.join(hashes['script'])}; "
        f"style-src {' '.join(hashes['style'])}; connect-src 'self'; img-src data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode(), csp


class DashboardPage:
    """Answers GET /dashboard itself and hands every other request on. Added as the outermost
    middleware, so it stands in front of the api-key check (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._page, self._csp = render_page()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PATHS:
            return await self.app(scope, receive, send)
        headers = {
            "Content-Security-Policy": self._csp,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        }
        if scope["method"] not in ("GET", "HEAD"):
            headers["Allow"] = "GET, HEAD"
            response = Response(status_code=405, headers=headers)
        else:
            response = Response(self._page, media_type="text/html; charset=utf-8", headers=headers)
        await response(scope, receive, send)
