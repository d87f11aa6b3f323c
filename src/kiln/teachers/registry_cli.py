"""`kiln teachers add|list|show|remove`: the teacher registry of a running server (HTTP client)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from kiln.client import UrlOpt, request

app = typer.Typer(help="Register, list, show and remove teachers on a running server.", no_args_is_help=True)


def _summary(t: dict) -> str:
    bounds = t.get("bounds") or {}
    return (f"{t['alias']}: {t['kind']}{'/' + t['provider'] if t.get('provider') else ''} "
            f"model={t.get('model_id')} status={t['status']} usable={t['usable']} "
            f"max_top_k={bounds.get('max_top_k')} revision={(t.get('identity_revision') or '')[:12]}")


@app.command()
def add(
    alias: str = typer.Argument(..., help="immutable name for the teacher"),
    kind: str = typer.Option("remote", "--kind", help="remote or local"),
    provider: Optional[str] = typer.Option(None, "--provider", help="remote: vllm or kiln"),
    model_id: Optional[str] = typer.Option(None, "--model-id", help="remote: the teacher's served model ID"),
    teacher_url: Optional[str] = typer.Option(None, "--teacher-url", help="remote: the teacher's exact base URL"),
    credential_id: Optional[str] = typer.Option(None, "--credential-id",
                                                help="a [teachers.credentials.<id>] entry of the server's kiln.toml"),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="local: a loaded adapter to teach with"),
    url: str = UrlOpt,
    as_json: bool = typer.Option(False, "--json", help="print the full response"),
) -> None:
    """Register a teacher (the server probes it first)."""
    body = {"alias": alias, "kind": kind}
    for key, value in (("provider", provider), ("model_id", model_id), ("url", teacher_url),
                       ("credential_id", credential_id), ("adapter", adapter)):
        if value is not None:
            body[key] = value
    t = request("POST", f"{url.rstrip('/')}/v1/teachers", json=body)
    typer.echo(json.dumps(t, indent=2) if as_json else "registered " + _summary(t))


@app.command("list")
def list_(url: str = UrlOpt) -> None:
    """List registered teachers."""
    for t in request("GET", f"{url.rstrip('/')}/v1/teachers")["data"]:
        typer.echo(_summary(t))


@app.command()
def show(alias: str, url: str = UrlOpt) -> None:
    """Show one teacher (identity, bounds, off_policy_manifest) as JSON."""
    typer.echo(json.dumps(request("GET", f"{url.rstrip('/')}/v1/teachers/{alias}"), indent=2))


@app.command()
def remove(alias: str, url: str = UrlOpt) -> None:
    """Delete a teacher alias."""
    request("DELETE", f"{url.rstrip('/')}/v1/teachers/{alias}")
    typer.echo(f"removed {alias}")
