"""`kiln ranks` commands: decide a declared rank population, or acquire one.

Exit codes (both commands): 0 coherent, 1 refused, 2 invalid input or options.
``observe`` also exits 3 when the world could not be formed. Messages for codes
2 and 3 go to stderr; the decision JSON goes to stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

app = typer.Typer(help="Tensor-parallel rank-population law.", no_args_is_help=True)

EXIT_COHERENT = 0
EXIT_REFUSED = 1
EXIT_INVALID_INPUT = 2
EXIT_ACQUISITION_FAILED = 3


def _fail(code: int, message: str) -> "typer.Exit":
    typer.echo(f"kiln ranks: {message}", err=True)
    return typer.Exit(code)


def _emit(value: dict[str, Any]) -> None:
    """One line of compact JSON on stdout, keys in the order given."""
    from kiln.canonical import ordered_json_bytes

    typer.echo(ordered_json_bytes(value).decode("utf-8"))


def _read_bounded(path: str, limit: int) -> bytes:
    """Read at most ``limit`` bytes (one more to detect overflow) from a regular file or ``-``.

    A named path goes through :func:`kiln.canonical.read_regular_file`: a FIFO, device or directory is
    refused at once instead of blocking, as every reader of a user-named path does."""
    from kiln.canonical import FileTooLargeError, read_regular_file

    try:
        if path == "-":
            return sys.stdin.buffer.read(limit + 1)
        return read_regular_file(path, limit)
    except FileTooLargeError:
        raise _fail(EXIT_INVALID_INPUT, f"{path}: the observation is larger than the {limit}-byte limit") from None
    except OSError as exc:
        raise _fail(EXIT_INVALID_INPUT, f"cannot read {path}: {exc.strerror or exc}") from None


@app.command("check")
def check(
    file: str = typer.Argument(..., metavar="FILE.json", help="Declared observation (JSON object), or - for stdin."),
) -> None:
    """Decide whether a declared rank population is coherent."""
    from kiln.system.ranks import MAX_OBSERVATION_BYTES, ObservationInputError, decide_rank_population
    from kiln.system.ranks import parse_observation_json

    data = _read_bounded(file, MAX_OBSERVATION_BYTES)
    try:
        observation = parse_observation_json(data)
    except ObservationInputError as exc:
        raise _fail(EXIT_INVALID_INPUT, f"{file}: {exc}") from None
    decision = decide_rank_population(observation)
    _emit(decision.to_json_dict())
    raise typer.Exit(EXIT_COHERENT if decision.coherent else EXIT_REFUSED)


@app.command("observe")
def observe(
    nproc_per_host: int = typer.Option(..., "--nproc-per-host", help="Worker processes to start on this host."),
    nnodes: int = typer.Option(1, "--nnodes", help="Hosts in the world; run this command on each."),
    node_rank: int = typer.Option(0, "--node-rank", help="This host's index; node 0 collects and decides."),
    master_addr: Optional[str] = typer.Option(
        None, "--master-addr", show_default=False, help="Rendezvous address of node 0 [default: 127.0.0.1]."
    ),
    master_port: int = typer.Option(0, "--master-port", help="Rendezvous port; 0 picks one (single host only)."),
    selected_host: Optional[List[str]] = typer.Option(
        None, "--selected-host", help="A host the deployment meant to use (repeat per host; default: this host)."
    ),
    tensor_parallel_size: Optional[int] = typer.Option(
        None, "--tensor-parallel-size", show_default=False,
        help="Ranks per TP group (consecutive ranks) [default: world size / PP size].",
    ),
    pipeline_parallel_size: int = typer.Option(
        1, "--pipeline-parallel-size", help="Ranks per PP group (strided by the TP size)."
    ),
    incarnation: Optional[str] = typer.Option(
        None, "--incarnation", show_default=False,
        help="The run this host's ranks belong to; the same on every host [default: random, single host only].",
    ),
    timeout_s: Optional[float] = typer.Option(
        None, "--timeout-s", show_default=False, help="Seconds each rendezvous step waits for peers [default: 60]."
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON result here (atomically)."),
) -> None:
    """Start a gloo world, create its TP/PP groups, gather what every rank observes and decide it."""
    from kiln.canonical import atomic_write_json
    from kiln.cluster.acquire import (
        AcquisitionConfigError,
        AcquisitionError,
        GridLayout,
        WorldPlan,
        acquire_rank_population,
    )

    given: dict[str, Any] = {"master_addr": master_addr, "timeout_s": timeout_s}
    try:
        plan = WorldPlan(
            nproc_per_host=nproc_per_host,
            nnodes=nnodes,
            node_rank=node_rank,
            master_port=master_port,
            selected_hosts=tuple(selected_host or ()),
            incarnation=incarnation,
            **{name: value for name, value in given.items() if value is not None},
        )
        tp = tensor_parallel_size
        if tp is None:  # the rest of the world, once PP has taken its share
            tp = max(plan.world_size // max(pipeline_parallel_size, 1), 1)
        layout = GridLayout(tp, pipeline_parallel_size)
        layout.groups_for(plan.world_size)  # refuses a world the groups cannot cut, before any rank starts
    except AcquisitionConfigError as exc:
        raise _fail(EXIT_INVALID_INPUT, str(exc)) from None
    try:
        outcome = acquire_rank_population(plan, layout)
    except AcquisitionError as exc:
        raise _fail(EXIT_ACQUISITION_FAILED, str(exc)) from None
    if outcome is None:
        result: dict[str, Any] = {"node_rank": node_rank, "reported_to": f"{plan.master_addr}:{plan.master_port}"}
        code = EXIT_COHERENT
    else:
        result = outcome.to_json_dict()
        code = EXIT_COHERENT if outcome.decision.coherent else EXIT_REFUSED
    if out is not None:
        atomic_write_json(out, result)
    _emit(result)
    raise typer.Exit(code)


if __name__ == "__main__":  # `python -m kiln.cluster.cli` runs the group on its own
    app()
