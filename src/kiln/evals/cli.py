"""`kiln eval` commands (client side: they talk to a running server over HTTP)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.client import UrlOpt, fail, request
from kiln.client import follow as follow_state

app = typer.Typer(help="Eval suites, runs, comparisons, strict replay and gates on a running server.",
                  no_args_is_help=True)
suites_app = typer.Typer(help="Create, import, list, show and delete suites.", no_args_is_help=True)
app.add_typer(suites_app, name="suites")

MAX_FILE_BYTES = 32 * 1024 * 1024


def _read(path: Path) -> str:
    if not path.is_file():
        fail(f"{path} is not a file")
    if path.stat().st_size > MAX_FILE_BYTES:
        fail(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return path.read_text("utf-8")


def _target(adapter: Optional[str], revision: Optional[str] = None) -> dict[str, Any]:
    return {} if adapter is None else {"adapter": adapter, **({"revision": revision} if revision else {})}


def follow(url: str, run_id: str) -> dict[str, Any]:
    """A progress bar for ``run_id`` until it is terminal; return the final run."""

    def progress(run: dict[str, Any]) -> tuple[int | None, int, str]:
        prog = run.get("progress") or {}
        total = prog.get("examples") or prog.get("targets")
        return total, prog.get("generated") or prog.get("targets_done") or 0, run["state"]

    return follow_state(f"{url}/v1/evals/runs/{run_id}", run_id, progress)


def _show_run(run: dict[str, Any], examples: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    res = run.get("result") or {}
    console.print(f"[bold]{run['id']}[/bold] {run['kind']} {run['state']}"
                  + (f"  error: {run['error']}" if run.get("error") else ""))
    if "aggregate" in res:
        a = res["aggregate"]
        tgt = res.get("target") or {}
        console.print(f"target {tgt.get('adapter') or 'base'}"
                      + (f"@{tgt['revision'][:12]}" if tgt.get("revision") else "")
                      + f": {a['passed']}/{a['examples']} passed, accuracy {a['accuracy']:.3f}, "
                      f"Wilson 95% low {a['wilson_lower_95']:.3f} ({a['aggregation']})")
    if "aggregates" in res:
        table = Table("target", "run", "passed", "accuracy")
        for a in res["aggregates"]:
            t = a["target"]
            table.add_row(f"{t.get('adapter') or 'base'}" + (f"@{t['revision'][:12]}" if t.get("revision") else ""),
                          a["run"], f"{a['passed']}/{a['examples']}", f"{a['accuracy']:.3f}")
        console.print(table)
        for p in res.get("pairwise_vs_first", []):
            n = p["numbers"]
            console.print(f"{p['target'].get('adapter') or 'base'} vs first: wins {n['candidate_only']}, "
                          f"losses {n['baseline_only']}, sign test p={n['p_value']:.4g}")
    if "gate" in res:
        g = res["gate"]
        console.print(f"gate {g['rule']}: [bold]{g['verdict']}[/bold] - {g['reason']}")
    if "replay" in res:
        r = res["replay"]
        console.print(f"replay: [bold]{r['verdict']}[/bold] ({r.get('stage')})"
                      + (f", {len(r.get('differences') or [])} difference(s)" if r.get("differences") else ""))
    if examples and "examples" in res:
        table = Table("id", "passed", "completion")
        for ex in res["examples"]:
            table.add_row(str(ex["id"]), "yes" if ex["passed"] else "no", ex["samples"][0]["completion"][:80])
        console.print(table)


def _submit_and_follow(url: str, path: str, body: dict[str, Any], wait: bool) -> None:
    run = request("POST", f"{url}{path}", json=body)
    typer.echo(f"queued {run['id']}")
    if not wait:
        return
    run = follow(url, run["id"])
    _show_run(run)
    if run["state"] != "succeeded":
        raise typer.Exit(1)


@suites_app.command("list")
def suites_list(url: str = UrlOpt) -> None:
    """List stored suites."""
    for s in request("GET", f"{url}/v1/evals/suites")["data"]:
        typer.echo(f"{s['name']:<32} {s['examples']:>5} examples  {','.join(s['scorers'])}  {s['aggregation']}")


@suites_app.command("create")
def suites_create(file: Path = typer.Argument(..., help="suite JSON file"), replace: bool = False,
                  url: str = UrlOpt) -> None:
    """Store a suite from a JSON file (examples, scorers, generation, aggregation)."""
    try:
        body = json.loads(_read(file))
    except json.JSONDecodeError as exc:
        fail(f"{file}: not JSON: {exc}")
    out = request("POST", f"{url}/v1/evals/suites", params={"replace": replace}, json=body)
    typer.echo(f"stored {out['name']} ({out['examples']} examples, sha256 {out['suite_sha256'][:12]})")


@suites_app.command("import")
def suites_import(file: Path = typer.Argument(..., help="JSONL: one {messages, reference[, id]} per line"),
                  name: str = typer.Option(..., "--name"),
                  scorer: list[str] = typer.Option(["exact"], "--scorer", help="scorer type (repeatable) or JSON"),
                  max_tokens: int = typer.Option(64, "--max-tokens"), replace: bool = False,
                  url: str = UrlOpt) -> None:
    """Import a JSONL dataset as a suite."""
    scorers = [json.loads(sc) if sc.lstrip().startswith("{") else {"type": sc} for sc in scorer]
    out = request("POST", f"{url}/v1/evals/suites/import", json={
        "name": name, "jsonl": _read(file), "scorers": scorers, "generation": {"max_tokens": max_tokens},
        "replace": replace})
    typer.echo(f"stored {out['name']} ({out['examples']} examples)")


@suites_app.command("show")
def suites_show(name: str, url: str = UrlOpt) -> None:
    typer.echo(json.dumps(request("GET", f"{url}/v1/evals/suites/{name}"), indent=2))


@suites_app.command("delete")
def suites_delete(name: str, url: str = UrlOpt) -> None:
    request("DELETE", f"{url}/v1/evals/suites/{name}")
    typer.echo(f"deleted {name}")


@app.command("run")
def run(suite: str = typer.Argument(..., help="stored suite name"),
        adapter: Optional[str] = typer.Option(None, "--adapter", help="evaluate this adapter (default: base)"),
        revision: Optional[str] = typer.Option(None, "--revision"),
        wait: bool = typer.Option(True, "--wait/--no-wait"), url: str = UrlOpt) -> None:
    """Run a suite against the base model or an adapter."""
    _submit_and_follow(url, "/v1/evals/runs", {"suite": suite, "target": _target(adapter, revision)}, wait)


@app.command("compare")
def compare(suite: str = typer.Argument(...),
            adapter: list[str] = typer.Option(..., "--adapter", help="adapter name, or 'base' (2-8, repeatable)"),
            wait: bool = typer.Option(True, "--wait/--no-wait"), url: str = UrlOpt) -> None:
    """Compare up to 8 adapters (or 'base') on one suite, paired per example."""
    targets = [_target(None if a == "base" else a) for a in adapter]
    _submit_and_follow(url, "/v1/evals/comparisons", {"suite": suite, "targets": targets}, wait)


@app.command("replay")
def replay(run_id: str, wait: bool = typer.Option(True, "--wait/--no-wait"), url: str = UrlOpt) -> None:
    """Strictly replay a succeeded run: matched, mismatch or error."""
    _submit_and_follow(url, "/v1/evals/replays", {"run_id": run_id}, wait)


@app.command("show")
def show(run_id: str, examples: bool = typer.Option(False, "--examples", help="list per-example results"),
         as_json: bool = typer.Option(False, "--json"), url: str = UrlOpt) -> None:
    """Show one run (aggregate, comparison table, gate verdict or replay verdict)."""
    run_ = request("GET", f"{url}/v1/evals/runs/{run_id}")
    if as_json:
        typer.echo(json.dumps(run_, indent=2))
        return
    _show_run(run_, examples)


@app.command("cancel")
def cancel(run_id: str, url: str = UrlOpt) -> None:
    out = request("DELETE", f"{url}/v1/evals/runs/{run_id}")
    typer.echo(f"{out['id']}: {out['state']}")
