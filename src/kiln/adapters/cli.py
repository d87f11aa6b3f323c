"""`kiln adapters` commands: client side (they talk to a running server), except ``verify``, which reads
the local adapter store."""

from __future__ import annotations

import typer

from pathlib import Path

from kiln.client import UrlOpt, request

app = typer.Typer(help="List, load, unload and delete adapters on a running server.", no_args_is_help=True)

REVISION_CHARS = 12


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command("list")
def list_cmd(url: str = UrlOpt) -> None:
    """Show the stored adapters, their current revision and whether the server is serving them."""
    from rich.console import Console
    from rich.table import Table

    data = request("GET", f"{url}/v1/adapters")["data"]
    table = Table(title=f"adapters on {url}")
    for col in ("name", "revision", "kind", "base", "size", "created", "active"):
        table.add_column(col)
    for a in data:
        active = "yes" if a["active"] else ""
        if a["active"] and a["active_revision"] != a["revision"]:
            active = f"yes (older {a['active_revision'][:REVISION_CHARS]})"
        if a.get("quarantined"):
            active += f" quarantined: {', '.join(r[:REVISION_CHARS] for r in a['quarantined'])}"
        table.add_row(a["name"], a["revision"][:REVISION_CHARS], a["kind"], a["base_model_sha256"][:REVISION_CHARS],
                      _size(a["size_bytes"]), a["created"], active.strip())
    Console(width=160).print(table)
    if not data:
        typer.echo("no adapters stored yet (train one with `kiln train sft`)")


@app.command()
def load(name: str, url: str = UrlOpt) -> None:
    """Serve NAME's current revision (requests select it with "model": NAME)."""
    body = request("POST", f"{url}/v1/adapters/{name}/load")
    typer.echo(f"serving {body['name']} revision {body['revision']}")


@app.command()
def unload(name: str, url: str = UrlOpt) -> None:
    """Stop serving NAME (running requests finish on their revision)."""
    request("POST", f"{url}/v1/adapters/{name}/unload")
    typer.echo(f"unloaded {name}")


@app.command()
def delete(name: str, url: str = UrlOpt) -> None:
    """Delete NAME and all its stored revisions (refused while it is being served)."""
    body = request("DELETE", f"{url}/v1/adapters/{name}")
    typer.echo(f"deleted {name} (revision {body['revision']})")


@app.command()
def default(name: str = typer.Argument(None, help="adapter to serve to requests naming the base model"),
            revision: str = typer.Option(None, help="a retained revision (default: the adapter's HEAD)"),
            clear: bool = typer.Option(False, "--clear", help="base-model requests get the bare base again"),
            url: str = UrlOpt) -> None:
    """Show, set (NAME) or clear (--clear) the server default adapter, pinned to one revision."""
    if clear and name:
        raise typer.BadParameter("give NAME or --clear, not both")
    if clear:
        body = request("DELETE", f"{url}/v1/adapters/default")
    elif name:
        body = request("PUT", f"{url}/v1/adapters/default", json={"name": name, "revision": revision})
    else:
        body = request("GET", f"{url}/v1/adapters/default")
    d = body["default"]
    if d is None:
        typer.echo("no default adapter: requests naming the base model get the base")
    else:
        state = "serving" if d["serving"] else f"NOT serving (the name serves {str(d['served_revision'])[:12]})"
        typer.echo(f"default adapter {d['name']} revision {d['revision']} ({state})")


@app.command()
def unquarantine(name: str, url: str = UrlOpt) -> None:
    """Lift the quarantine of NAME's revisions whose load or canary failed (after fixing them)."""
    body = request("POST", f"{url}/v1/adapters/{name}/quarantine/clear")
    lifted = ", ".join(r[:REVISION_CHARS] for r in body["cleared"]) or "nothing was quarantined"
    typer.echo(f"{name}: {lifted}")


@app.command()
def verify(target: str = typer.Argument(..., metavar="NAME[@REVISION]", help="an adapter (default: its HEAD)"),
           base_model: Path = typer.Option(None, "--base-model", help="a model directory: the revision must be "
                                           "for these weights"),
           base_model_sha256: str = typer.Option(None, "--base-model-sha256", help="the base model hash the "
                                                 "revision must be for"),
           home: Path = typer.Option(None, "--home", help="Kiln home (default: KILN_HOME / kiln.toml)")) -> None:
    """Check a stored revision offline: re-hash its files against its manifest, recompute the revision ID, and
    check its training receipt binds to that revision and base model. Exits 1 naming any mismatch."""
    from kiln.adapters.receipt import locality_summary
    from kiln.adapters.store import AdapterStore
    from kiln.config import ConfigError, load_settings
    from kiln.errors import KilnError

    name, _, revision = target.partition("@")
    try:
        try:
            settings = load_settings(cli={"home": str(home) if home else None}).settings
        except ConfigError as exc:
            raise KilnError(f"configuration: {exc}") from None
        if not settings.adapters_path.is_dir():
            raise KilnError(f"no adapter store at {settings.adapters_path}", hint="set KILN_HOME or --home")
        store = AdapterStore(settings.adapters_path)
        record = store.verify(name, revision or None)  # the manifest's revision is recomputed when it is read
        receipt = store.verify_receipt(record)
        want = base_model_sha256
        if base_model is not None:
            from kiln.runtime.loader import inspect_model_dir

            want = inspect_model_dir(base_model).base_model_sha256
        have = record.manifest.base_model_sha256
        if want is not None and want != have:
            raise KilnError(f"adapter {name!r} revision {record.revision} is for base model {have}, not {want}")
    except KilnError as exc:
        typer.echo(f"verify failed: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""), err=True)
        raise typer.Exit(1) from None
    m = record.manifest
    typer.echo(f"{name}@{record.revision}: {len(m.files)} files match the manifest; kind {m.kind}, base model "
               f"{m.base_model_sha256}")
    if receipt is None:
        typer.echo(f"no training receipt (kind {m.kind} is not published by a training job)")
        return
    gate = receipt["gate"]
    code = receipt["code"]
    typer.echo(f"receipt binds: job {receipt['job_id']}, plan {receipt['plan_sha256']}, inputs "
               f"{receipt['inputs']['inputs_sha256']}, config {receipt['adapter']['config_sha256']}")
    teacher = receipt["teacher"]
    if teacher:
        typer.echo("teacher: " + ", ".join(f"{k} {v}" for k, v in teacher.items() if v is not None))
    typer.echo(f"code: kiln {code['kiln_version']}" + (f" ({code['git_commit']})" if code.get("git_commit") else "")
               + "; gate: " + (gate.get("verdict", "?") if isinstance(gate, dict) else "none ran"))
    loc = locality_summary(receipt.get("locality"))
    if loc is not None:
        typer.echo(_locality_line(loc))


def _locality_line(loc: dict) -> str:
    """``kiln adapters verify``'s line for a receipt's locality (:func:`kiln.adapters.receipt.locality_summary`)."""
    if loc.get("error"):
        return f"locality: not measured ({loc['error']})"
    guard = loc["guard"]
    verdict = "passed" if not guard["code"] else guard["code"] + (" (admitted by override)" if guard["admitted"]
                                                                   else " (not activated by the job)")
    scoped = "; scoped to its corrections by scope auto" if loc.get("auto_scope") else ""
    return (f"locality: {loc['unchanged']} of {loc['probes']} probe answers unchanged, mean KL {loc['kl_mean']} "
            f"nats/token, {loc['degenerate']} made degenerate; guard {verdict}{scoped}")
