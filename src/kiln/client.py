"""The small HTTP client behind the `kiln train` and `kiln adapters` commands.

Standard library + httpx (imported on use) + typer: the commands that talk to a
running server share one URL option and one error rendering.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import typer

DEFAULT_URL = os.environ.get("KILN_URL", "http://127.0.0.1:8420")
HTTP_TIMEOUT_S = 60.0
POLL_S = 0.25
TERMINAL_STATES = ("succeeded", "failed", "cancelled")

UrlOpt = typer.Option(DEFAULT_URL, "--url", help="Kiln server URL ($KILN_URL)")
API_KEY_ENV = "KILN_API_KEY"  # the bearer token of a server started with server.api_key_env


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $KILN_API_KEY`` when that variable is set (else nothing)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit 1."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


def request(method: str, url: str, **kw: Any) -> dict[str, Any]:
    """One request; a 4xx/5xx becomes ``fail`` with the server's code, message and hint."""
    import httpx

    try:
        headers = {**auth_headers(), **(kw.pop("headers", None) or {})}
        r = httpx.request(method, url, timeout=HTTP_TIMEOUT_S, headers=headers, **kw)
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc} (is `kiln serve` running? pass --url)")
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code >= 400:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        hint = f"\nhint: {err['hint']}" if err.get("hint") else ""
        if r.status_code == 401 and not auth_headers():
            hint += f"\nhint: the server wants a bearer token: set {API_KEY_ENV}"
        fail(f"{r.status_code} {err.get('code', '')}: {err.get('message', r.text[:500])}{hint}")
    return body


MAX_ROWS_FILE_BYTES = 64 * 1024 * 1024


def read_json_rows(path: Path) -> list[dict[str, Any]]:
    """A JSONL file (one object per line) or a JSON array of objects; ``fail`` naming what is wrong."""
    if not path.is_file():
        fail(f"{path} is not a file")
    if path.stat().st_size > MAX_ROWS_FILE_BYTES:
        fail(f"{path} is larger than {MAX_ROWS_FILE_BYTES} bytes; put it in the server's data dir and use "
             "dataset_path")
    text = path.read_text("utf-8")
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        fail(f"{path}: not JSON/JSONL: {exc}")
    if not rows or not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        fail(f"{path} must hold one JSON object per line")
    return rows


BarState = tuple[int | None, int, str]  # (total, completed, info) for the bar


def follow(url: str, label: str, progress: Callable[[dict[str, Any]], BarState]) -> dict[str, Any]:
    """Poll ``GET url`` with a rich progress bar until its ``state`` is terminal; return the last body.

    ``progress(body)`` maps one answer to the bar's (total, completed, info).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Bar(*columns, transient=False) as bar:
        task = bar.add_task(label, total=None, info="queued")
        while True:
            body = request("GET", url)
            total, completed, info = progress(body)
            bar.update(task, total=total, completed=completed, info=info)
            if body["state"] in TERMINAL_STATES:
                return body
            time.sleep(POLL_S)
