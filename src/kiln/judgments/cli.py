"""`kiln judgments` commands (client side: they talk to a running server over HTTP).

Record A/B preferences one at a time or from a JSONL file, list and export them, train a judge
adapter on them, and ask a judge which of two responses is better (docs/evals.md, "Judgments").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.client import UrlOpt, fail, read_json_rows, request

app = typer.Typer(help="Record A/B judgments, train a judge adapter on them, compare two responses.",
                  no_args_is_help=True)

REQUIRED_FLAGS = {"prompt": "--prompt", "response_a": "--a", "response_b": "--b", "preferred": "--preferred"}


@app.command("add")
def add(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="what both responses answer"),
    response_a: Optional[str] = typer.Option(None, "--a", help="response A"),
    response_b: Optional[str] = typer.Option(None, "--b", help="response B"),
    preferred: Optional[str] = typer.Option(None, "--preferred", help="a, b or tie"),
    rationale: Optional[str] = typer.Option(None, "--rationale", help="why (kept, not trained on)"),
    author: Optional[str] = typer.Option(None, "--author", help="who judged"),
    file: Optional[Path] = typer.Option(None, "--file", "-f",
                                        help="JSONL (or a JSON array) of judgments, one object each"),
    url: str = UrlOpt,
) -> None:
    """Record one judgment (--prompt/--a/--b/--preferred) or every judgment in --file, in order.

    The server checks each one; the first it refuses stops the command, naming its line (the ones
    before it are recorded)."""
    single = {"prompt": prompt, "response_a": response_a, "response_b": response_b, "preferred": preferred,
              "rationale": rationale, "author": author}
    given = {k: v for k, v in single.items() if v is not None}
    if file is not None and given:
        fail("give either --file or the judgment's fields, not both")
    if file is None:
        missing = [flag for k, flag in REQUIRED_FLAGS.items() if k not in given]
        if missing:
            fail(f"missing {', '.join(missing)} (or pass --file)")
        rows = [given]
    else:
        rows = read_json_rows(file)
    from kiln.judgments.schemas import JudgmentCreate

    fields = tuple(JudgmentCreate.model_fields)  # the wire format's fields
    for line, row in enumerate(rows, 1):  # before anything is sent
        extra = sorted(set(row) - set(fields))
        if extra:
            fail(f"{file}: judgment {line}: unknown field(s) {', '.join(extra)}; fields: {', '.join(fields)}")
    for line, row in enumerate(rows, 1):
        try:
            stored = request("POST", f"{url}/v1/judgments", json=row)
        except typer.Exit:
            if file is not None:
                typer.secho(f"stopped at judgment {line} of {len(rows)} ({line - 1} recorded)", err=True)
            raise
        if file is None:
            typer.echo(stored["id"])
    if file is not None:
        typer.echo(f"recorded {len(rows)} judgments")


@app.command("list")
def list_(
    limit: int = typer.Option(20, "--limit", min=1, max=500, help="at most this many"),
    newest: bool = typer.Option(False, "--newest", help="newest first"),
    as_json: bool = typer.Option(False, "--json", help="print the page as JSON"),
    url: str = UrlOpt,
) -> None:
    """One page of judgments, oldest first (--newest: newest first)."""
    page = request("GET", f"{url}/v1/judgments", params={"limit": limit, "order": "desc" if newest else "asc"})
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "preferred", "prompt", "A", "B", "author")
    for j in page["data"]:
        table.add_row(j["id"], j["preferred"], _clip(j["prompt"]), _clip(j["response_a"]), _clip(j["response_b"]),
                      j.get("author") or "")
    console = Console()
    console.print(table)
    console.print(f"{len(page['data'])} of {page['total']} judgments")


@app.command("export")
def export(
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write here (default: standard output)"),
    url: str = UrlOpt,
) -> None:
    """Every judgment as JSONL, oldest first (what GET /v1/judgments/export streams)."""
    import httpx

    from kiln.client import HTTP_TIMEOUT_S, auth_headers

    try:
        with httpx.stream("GET", f"{url}/v1/judgments/export", timeout=HTTP_TIMEOUT_S, headers=auth_headers()) as r:
            if r.status_code >= 400:
                r.read()
                request("GET", f"{url}/v1/judgments/export")  # renders the server's error and exits
            out = open(output, "wb") if output is not None else sys.stdout.buffer
            try:
                for chunk in r.iter_bytes():
                    out.write(chunk)
            finally:
                if output is not None:
                    out.close()
                else:
                    out.flush()
    except httpx.HTTPError as exc:
        fail(f"cannot reach {url}: {exc} (is `kiln serve` running? pass --url)")


@app.command("train")
def train(
    adapter: str = typer.Argument(..., help="publish the judge adapter under this name"),
    limit: Optional[int] = typer.Option(None, "--limit", help="train on the most recent N non-tie judgments"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="default: until the answers are learned"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    learning_rate: Optional[float] = typer.Option(None, "--lr"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    auto_load: bool = typer.Option(False, "--auto-load", help="serve the judge once published"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the job with a progress bar"),
    url: str = UrlOpt,
) -> None:
    """Train a judge adapter (SFT, both presentation orders, ties left out) on the stored judgments."""
    from kiln.training.cli import follow

    body: dict[str, Any] = {"adapter": adapter, "auto_load": auto_load}
    for key, value in (("limit", limit), ("epochs", epochs), ("max_steps", max_steps),
                       ("learning_rate", learning_rate), ("seed", seed)):
        if value is not None:
            body[key] = value
    out = request("POST", f"{url}/v1/judgments/train", json=body)
    job = out["job"]
    typer.echo(f"submitted {job['id']}: {out['judgments']} judgments, {out['examples']} examples "
               f"(judgments {out['judgments_sha256'][:12]})")
    if not wait:
        return
    job = follow(url, job["id"])
    if job["state"] != "succeeded":
        fail(f"job {job['id']} {job['state']}: {job.get('error')}")
    res = job.get("result") or {}
    typer.echo(f"published {adapter} revision {res.get('revision')}")


@app.command("compare")
def compare(
    prompt: str = typer.Option(..., "--prompt"),
    response_a: str = typer.Option(..., "--a", help="response A"),
    response_b: str = typer.Option(..., "--b", help="response B"),
    judge: Optional[str] = typer.Option(None, "--judge", help="a served judge adapter (default: the base model)"),
    as_json: bool = typer.Option(False, "--json", help="print the server's answer as JSON"),
    url: str = UrlOpt,
) -> None:
    """Which response the judge prefers: P(A is better), averaged over both presentation orders."""
    body: dict[str, Any] = {"prompt": prompt, "response_a": response_a, "response_b": response_b}
    if judge is not None:
        body["judge"] = judge
    out = request("POST", f"{url}/v1/judgments/compare", json=body)
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    who = f"{out['judge']}@{out['judge_revision'][:12]}" if out.get("judge") else "base model"
    typer.echo(f"{out['preferred']}  P(A better) {out['p_a']:.3f}  (orders {out['orders'][0]:.3f}, "
               f"{out['orders'][1]:.3f}; judge {who})")


def _clip(text: str, width: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
