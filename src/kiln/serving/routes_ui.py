"""The dashboard: static files shipped in ``kiln/ui`` served at ``/ui/`` (``/`` and ``/ui`` redirect there).

No build step and nothing fetched from elsewhere: ``index.html``, ``app.js`` and
``app.css`` are plain files in the package. Every action of the page goes
through the public API, with the same security checks as any other client.

Only files present in the package directory are served, by exact name (no
subdirectories, no path walking), each with its content type, ``nosniff`` and a
strict Content-Security-Policy: everything from this origin only, no inline
scripts or styles, no framing.
"""

from __future__ import annotations

import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from kiln.errors import NotFound

router = APIRouter(include_in_schema=False)

UI_PREFIX = "/ui/"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def _asset(name: str) -> Response:
    suffix = name[name.rfind("."):] if "." in name else ""
    content_type = CONTENT_TYPES.get(suffix)
    if not _NAME.match(name) or content_type is None:
        raise NotFound(f"no dashboard file {name!r}", code="not_found", hint="the dashboard is at /ui/")
    path = resources.files("kiln").joinpath("ui", name)
    if not path.is_file():
        raise NotFound(f"no dashboard file {name!r}", code="not_found", hint="the dashboard is at /ui/")
    return Response(path.read_bytes(), media_type=content_type, headers=SECURITY_HEADERS)


@router.get("/")
@router.get("/ui")
def ui_redirect() -> RedirectResponse:
    return RedirectResponse(UI_PREFIX, status_code=307)


@router.get("/ui/")
def ui_index() -> Response:
    return _asset("index.html")


@router.get("/ui/{name}")
def ui_file(name: str) -> Response:
    return _asset(name)
