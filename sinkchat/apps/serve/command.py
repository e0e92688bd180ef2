"""`sinkchat serve`: an OpenAI-compatible HTTP server on the one model, one persistent sink cache per session.

Localhost only unless an API key is given: binding any other address without `--api-key` is refused, because
anyone who reaches the port could otherwise run the model and read every session. See docs/serve.md.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
from pathlib import Path
from typing import Any

import click

from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.config import ConfigError, data_dir

log = logging.getLogger(__name__)


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def model_id(source: Any) -> str:
    """The id /v1/models lists: the model's file or folder name (without .gguf)."""
    name = Path(str(source or "sinkchat")).name
    return name.removesuffix(".gguf") or "sinkchat"


@click.command("serve")
@common_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (anything but localhost needs --api-key)")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="port (0: any free one, printed at start)")
@click.option("--api-key", default=None, envvar="SINKCHAT_API_KEY", help="require 'Authorization: Bearer KEY' on /v1 [env SINKCHAT_API_KEY]")
@click.option("--system", default=None, help="system prompt for requests that bring none (default: none)")
@click.option("--sessions", "session_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="session store: one snapshot per X-Session-Id (default: DATA_DIR/serve/sessions); servers sharing it continue each other's sessions")
@click.option("--max-sessions", type=click.IntRange(1, 10_000), default=8, show_default=True, help="sessions kept in RAM; the least recently used are reloaded from the store on demand")
@click.option("--max-queue", type=click.IntRange(0, 10_000), default=8, show_default=True, help="requests that may wait behind the running one; more get 429")
@click.option("--max-body", type=click.IntRange(1024, None), default=4 << 20, show_default=True, help="largest request body in bytes (413 beyond)")
@click.option("--no-log", is_flag=True, help="do not log sessions to the SQLite session log")
def serve_command(host: str, port: int, api_key: str | None, system: str | None, session_dir: Path | None,
                  max_sessions: int, max_queue: int, max_body: int, no_log: bool, **kwargs: Any) -> None:
    """Serve the model over the OpenAI API: POST /v1/chat/completions (tools, response_format, streaming),
    /v1/completions, GET /v1/models, /v1/sessions/{id}, /health. Name a session with the X-Session-Id header
    and it keeps its own sink cache for good: each request feeds only its new messages."""
    opts = pop_common(kwargs)
    setup_logging(opts["verbose"] or 0)
    with user_errors():
        if not is_local(host) and not api_key:
            raise ConfigError(f"--host {host} would expose the server beyond this machine: give --api-key too")
        settings = build_settings(opts)
        _serve(settings, host, port, api_key, system, session_dir or data_dir() / "serve" / "sessions",
               max_sessions, max_queue, max_body, no_log)


def _serve(settings: Any, host: str, port: int, api_key: str | None, system: str | None, store_dir: Path,
           max_sessions: int, max_queue: int, max_body: int, no_log: bool) -> None:
    import uvicorn

    from sinkchat.api import start
    from sinkchat.apps.serve.app import STOP_GRACE, Server, build_app
    from sinkchat.apps.serve.runner import Runner
    from sinkchat.apps.serve.sessions import SessionStore

    sock = _bind(host, port)  # before the model loads: a port in use was found only after it (uvicorn's error)
    engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
    mid = model_id(getattr(engine.loaded, "source", None) or settings.model.model)
    store = SessionStore(engine, store_dir, max_sessions, None if no_log else _log_opener(engine, mid))
    server = Server(Runner(engine, store, system), mid, api_key, max_queue, max_body)
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=10, lifespan="off")
    srv = uvicorn.Server(config)
    server.stopping = lambda: bool(srv.should_exit)
    _keep_streams_on_shutdown()
    click.echo(f"sinkchat serve: model {mid}, cache {engine.cache_cfg.capacity}, sessions in {store_dir}", err=True)
    _announce(srv, host)
    signal.signal(signal.SIGTERM, _terminated)  # uvicorn drains, puts this back and raises the signal again
    try:
        srv.run(sockets=[sock])
    except SystemExit as e:  # (`_terminated`): say so, as a user stopping the service reads its log
        if e.code == 128 + signal.SIGTERM:
            click.echo(f"sinkchat serve: stopped by SIGTERM (requests in flight had up to {STOP_GRACE:g} s to finish); "
                       f"sessions are kept in {store_dir} and go on when a server starts again", err=True)
        raise
    finally:
        server.executor.shutdown(wait=True, cancel_futures=True)
        store.close()


def _bind(host: str, port: int) -> Any:
    """The server's socket, bound now (uvicorn listens on it): ConfigError in one line when the address is taken
    or cannot be had."""
    import socket

    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        why = "the port is in use (another server?)" if e.errno == errno.EADDRINUSE else e.strerror
        raise ConfigError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM once uvicorn has drained the requests in flight: unwind (closing the session logs), exit 143 as
    `sinkchat chat` does."""
    raise SystemExit(128 + signum)


def _keep_streams_on_shutdown() -> None:
    """sse-starlette cancels every open stream the moment uvicorn gets SIGTERM (its AppStatus hook), cutting a
    streamed reply without its final chunk or [DONE]. Off: uvicorn's graceful shutdown waits for the streams, and
    Server._deadline stops a reply that would outlast it, so every stream still ends properly."""
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()


def _log_opener(engine: Any, mid: str) -> Any:
    """(sid, log id or None) -> the session's SQLite log (`sinkchat logs`): mode 'serve', resumed when the session
    had one. Its tokens: what the engine processed while the session was installed (`opener.switch`, runlog)."""
    from dataclasses import asdict

    from sinkchat.apps.runlog import SharedTally
    from sinkchat.store.sessionlog import SessionLog

    tally = SharedTally(engine)

    def opener(sid: str, log_id: int | None) -> Any:
        if log_id is not None:
            return SessionLog.resume(int(log_id), warn=log.warning, tokens=tally.counter(sid))
        settings = {"cache": asdict(engine.cache_cfg), "sampling": asdict(engine.sampling), "session": sid}
        return SessionLog.open("serve", mid, settings, warn=log.warning, tokens=tally.counter(sid))

    opener.switch = tally.switch  # type: ignore[attr-defined]  # SessionStore.activate: whose tokens these are
    return opener


def _announce(srv: Any, host: str) -> None:
    """Print the address once the socket is bound (with --port 0 the kernel picked it): tests and scripts read
    this line to know where to connect."""
    import threading
    import time

    def watch() -> None:
        while not srv.started and not srv.should_exit:
            time.sleep(0.05)
        for s in getattr(srv, "servers", []):
            for sock in s.sockets:
                click.echo(f"listening on http://{host}:{sock.getsockname()[1]}", err=True)
                return

    threading.Thread(target=watch, daemon=True).start()
