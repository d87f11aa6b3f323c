"""`kiln adapters` commands (client side: they talk to a running server)."""

from __future__ import annotations

import typer

from kiln.client import UrlOpt, request

app = typer.Typer(help="List, load, unload and delete adapters on a running server.", no_args_is_help=True)

REVISION_CHARS = 12


def _size(n: int) -> str:
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
