"""`kiln serve`: start the OpenAI-compatible server.

Start-up order: merge and validate the configuration (flags are its CLI layer),
pick the device, verify and load the model (the built-in one when no path is
configured), size the KV cache, start the engine and training, then bind HTTP and
print the URLs. SIGINT/SIGTERM shut down gracefully: open requests end, the
engine stops, the process exits 0.

The process runs with umask 077, so every file and directory it creates under
``$KILN_HOME`` is private to the user. Slow clients are bounded: the request head
by ``server.header_timeout_s`` (uvicorn has no such timeout: see
:func:`kiln.serving.security.header_timeout_protocol`), the body by
``server.body_timeout_s`` (security middleware), idle keep-alive connections by
``server.keep_alive_timeout_s`` and shutdown by ``server.graceful_shutdown_s``.
"""

from __future__ import annotations

import gc
import shlex
import sys
from contextlib import contextmanager
from typing import Any, Optional

import typer


def serve(
    config: Optional[str] = typer.Option(None, "--config", help="kiln.toml to read (else $KILN_CONFIG or ./kiln.toml)"),
    host: Optional[str] = typer.Option(None, help="bind address [server.host]"),
    port: Optional[int] = typer.Option(None, help="TCP port, 0 for any free one [server.port]"),
    model: Optional[str] = typer.Option(None, "--model", help="local model directory [model.path]; default built-in"),
    served_model_id: Optional[str] = typer.Option(None, help="model ID clients send [model.served_model_id]"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N [model.device]"),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 | float16 [model.dtype]"),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="none | int8 | int4: weight-only quantization of the base's linear layers "
                                 "[model.quantize]"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads, 0 = all cores but one [model.threads]"),
    prefill_threads: Optional[int] = typer.Option(
        None, help="torch CPU threads for prompt-only engine cycles, 0 = all cores when --threads is 0 "
                   "[model.prefill_threads]"),
    token_budget: Optional[int] = typer.Option(None, help="tokens per scheduling cycle [batching.token_budget]"),
    max_running_rows: Optional[int] = typer.Option(None, help="rows decoding at once [batching.max_running_rows]"),
    max_queued_rows: Optional[int] = typer.Option(None, help="rows waiting for a slot [batching.max_queued_rows]"),
    prefill_chunk_tokens: Optional[int] = typer.Option(None, help="prompt chunk size [batching.prefill_chunk_tokens]"),
    mixed_step_factor: Optional[float] = typer.Option(
        None, help="a cycle with prompt tokens beside decoding rows <= this x a decode-only one, 0 = off "
                   "[batching.mixed_step_factor]"),
    max_model_len: Optional[int] = typer.Option(None, help="prompt + output token limit [limits.max_model_len]"),
    request_timeout_s: Optional[float] = typer.Option(None, help="per-request limit [server.request_timeout_s]"),
    log_level: Optional[str] = typer.Option(None, help="debug | info | warning | error [server.log_level]"),
    training: Optional[bool] = typer.Option(None, "--training/--no-training", help="[training.enabled]"),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="experimental (everything) | stable (serving only: no training, no merges) "
                                "[serving.profile]"),
    home: Optional[str] = typer.Option(None, help="Kiln home directory [home] (default $KILN_HOME, ~/.cache/kiln)"),
    engine: Optional[str] = typer.Option(None, "--engine", help="builtin | vllm (a vLLM subprocess) [serving.engine]"),
    tool_call_parser: Optional[str] = typer.Option(
        None, "--tool-call-parser",
        help="auto (by chat template) | hermes | deepseek_v3 | llama3_json | mistral [serving.tool_call_parser]"),
    reasoning_parser: Optional[str] = typer.Option(
        None, "--reasoning-parser", help="auto (by chat template) | none | qwen3 | deepseek_r1 "
                                         "[serving.reasoning_parser]"),
) -> None:
    """Start the OpenAI-compatible server (built-in model unless --model is given)."""
    from kiln.config import ConfigError, load_settings

    cli = {
        "home": home,
        "server.host": host,
        "server.port": port,
        "server.request_timeout_s": request_timeout_s,
        "server.log_level": log_level,
        "model.path": model,
        "serving.profile": profile,
        "model.served_model_id": served_model_id,
        "model.device": device,
        "model.dtype": dtype,
        "model.quantize": quantize,
        "model.threads": threads,
        "model.prefill_threads": prefill_threads,
        "batching.token_budget": token_budget,
        "batching.max_running_rows": max_running_rows,
        "batching.max_queued_rows": max_queued_rows,
        "batching.prefill_chunk_tokens": prefill_chunk_tokens,
        "batching.mixed_step_factor": mixed_step_factor,
        "limits.max_model_len": max_model_len,
        "training.enabled": training,
        "serving.engine": engine,
        "serving.tool_call_parser": tool_call_parser,
        "serving.reasoning_parser": reasoning_parser,
    }
    try:
        loaded = load_settings(cli=cli, config_path=config)
    except ConfigError as exc:
        typer.echo(f"kiln serve: {exc}", err=True)
        raise typer.Exit(2) from None
    app, model_id = _build_app(loaded)
    if not _run_server(app, loaded.settings.server, model_id):
        raise typer.Exit(1)


def _build_app(loaded: Any) -> tuple[Any, str]:
    """Load the model and build the state and the app (private umask first); a problem exits with status 2."""
    import os

    from kiln.config import ConfigError
    from kiln.runtime.loader import ModelLoadError
    from kiln.serving.app import build_state, create_app
    from kiln.serving.security import ApiKeyMissing
    from kiln.serving.state import PRIVATE_UMASK

    os.umask(PRIVATE_UMASK)
    typer.echo(f"kiln serve: loading model {loaded.settings.model.path or '(built-in)'} ...", err=True)
    try:
        state = build_state(loaded)
    except (ModelLoadError, ConfigError) as exc:  # ConfigError: a [vllm] problem found while resolving it
        typer.echo(f"kiln serve: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        return create_app(loaded, state=state), state.model_id
    except ApiKeyMissing as exc:
        typer.echo(f"kiln serve: {exc}", err=True)
        raise typer.Exit(2) from None


def _run_server(app: Any, srv: Any, model_id: str) -> bool:
    """Serve ``app`` with uvicorn under the [server] settings ``srv`` until a signal; whether it started."""
    import uvicorn

    from kiln.serving.security import MAX_REQUEST_HEAD_BYTES, header_timeout_protocol

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.should_exit or not self.servers:
                return
            # Everything built so far (model, tokenizer, engine) lives until exit: move it out of the
            # collector's reach so full collections stay short while serving (as vLLM does).
            gc.collect()
            gc.freeze()
            bound = self.servers[0].sockets[0].getsockname()
            _print_ready(bound[0], bound[1], model_id)

        @contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
            # by the signal; the shutdown has completed, so exit 0 instead, as the docs promise.
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    server = _Server(uvicorn.Config(
        app, host=srv.host, port=srv.port, log_level=srv.log_level, access_log=srv.log_level == "debug",
        http=header_timeout_protocol(_uvicorn_http_protocol(), srv.header_timeout_s),
        timeout_keep_alive=srv.keep_alive_timeout_s, timeout_graceful_shutdown=srv.graceful_shutdown_s,
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,  # h11 answers 400 past it; httptools: the protocol
    ))
    server.run()
    return bool(server.started)


def _uvicorn_http_protocol() -> type:
    """The protocol uvicorn's ``http="auto"`` would pick (httptools when installed, else h11)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def _print_ready(host: str, port: int, model_id: str) -> None:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}" if ":" not in shown else f"http://[{shown}]:{port}"
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"temperature": 0}' % model_id)
    lines = [
        f"Kiln is ready: serving {model_id!r}",
        f"  OpenAI base URL: {base}/v1",
        f"  health:          {base}/health",
        f"  metrics:         {base}/metrics",
        f"  API docs:        {base}/docs",
        "Try it:",
        f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}",
    ]
    print("\n".join(lines), flush=True)
    sys.stdout.flush()
