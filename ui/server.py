"""`lvx serve`: open the engine once, share it through one engine service between the browser chat
and the OpenAI-compatible API (the API alone with --no-ui), close it on exit."""

from __future__ import annotations

import hmac
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lvx_app.config import LOOPBACK, Config, ServeConfig
from lvx_app.engine.api import EngineError
from lvx_app.runtime.open import open_engine
from lvx_app.runtime.service import EngineService


def check_allow_paths(paths: list[str]) -> list[str]:
    """The folders whose videos may be opened by path, resolved; a missing one is one line."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise EngineError(
                f"--allow-paths {p} is not a directory; name a folder that holds your videos"
            )
        out.append(str(path.resolve()))
    return out


def _wait_for_a_stop_signal(serving: Callable[[], bool] = lambda: True) -> str | None:
    """Serve until Ctrl-C or SIGTERM arrives (its name: the log says which one stopped us) or
    `serving()` turns false (None)."""
    stop, got = threading.Event(), []

    def handler(signum, frame) -> None:
        got.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    while serving() and not stop.wait(0.5):
        pass
    if not got:
        return None
    return "Ctrl-C" if got[0] == "SIGINT" else got[0]


def _stop_on_sigterm() -> None:
    """SIGTERM ends Gradio's wait loop like Ctrl-C does, so the engine is closed and the group shut
    down."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_serve(config: Config, console: Console | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM; returns the process exit code."""
    console = console or Console(highlight=False, soft_wrap=True)
    try:
        folders = check_allow_paths(config.serve.allow_paths)
        _stop_on_sigterm()
        engine = open_engine(config, console)
        service = EngineService(
            engine,
            reopen=lambda: open_engine(config),
            queue_size=config.serve.queue_size,
            report=lambda line: console.print(f"lvx serve: {line}", markup=False),
        )
        try:
            _serve(service, config, folders, console)
        finally:
            service.close()  # the engine it holds now (a dead group is replaced by a fresh one)
        return 0
    except EngineError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the model was still loading
        console.print("stopped")
        return 130
    except OSError as exc:  # e.g. the port is taken
        console.print(f"[red]error:[/red] {escape(str(exc))}; pick another --port")
        return 2


def _api(
    service: EngineService, config: Config, folders: list[str], uploads: str, console: Console
):
    """The OpenAI-compatible API on the engine `service` shares; data: URL videos go to
    `uploads`."""
    from lvx_ui.openai_api import OpenAIApi
    from lvx_ui.openai_request import VideoFiles

    files = VideoFiles(folders, config.serve.max_upload_mb, Path(uploads))
    return OpenAIApi(service, config, files, report=lambda line: console.print(line, markup=False))


def page_login(serve: ServeConfig) -> tuple[str, str] | Callable[[str, str], bool] | None:
    """What the page asks for at login: --auth's user and password; else, with --api-key, the key
    as the password (any user name), so the key guards the page as it guards the API."""
    if serve.auth:
        user, _, password = serve.auth.partition(":")
        return user, password
    if not serve.api_key:
        return None
    key = serve.api_key.encode()

    def check(user: str, password: str) -> bool:
        return hmac.compare_digest(str(password).encode("utf-8", "replace"), key)

    return check


def _serve(service: EngineService, config: Config, folders: list[str], console: Console) -> None:
    with tempfile.TemporaryDirectory(prefix="lvx-api-videos-") as uploads:
        if config.serve.no_ui:
            _serve_api_alone(service, config, folders, uploads, console)
        else:
            _serve_page(service, config, folders, uploads, console)


def _serve_api_alone(
    service: EngineService, config: Config, folders: list[str], uploads: str, console: Console
) -> None:
    """The API alone under uvicorn (no gradio) until Ctrl-C; a dead group is restarted by the next
    request."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI(title="lvx", docs_url=None, redoc_url=None, openapi_url=None)
    _api(service, config, folders, uploads, console).mount(app)
    serve = config.serve
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=serve.host, port=serve.port, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)  # signals stay with this thread
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise OSError(f"could not listen on {serve.host}:{serve.port}")
        time.sleep(0.05)
    name = f"[{serve.host}]" if ":" in serve.host else serve.host
    console.print(f"lvx serve: ready on http://{name}:{serve.port}/ (the API at /v1, no page)")
    console.print("[dim]Ctrl-C stops the server and the worker group.[/dim]")
    stopped_by = _wait_for_a_stop_signal(thread.is_alive)
    server.should_exit = True
    thread.join()
    if stopped_by:
        console.print(f"lvx serve: stopped by {stopped_by}")


def _serve_page(
    service: EngineService, config: Config, folders: list[str], uploads: str, console: Console
) -> None:
    """Put the page (and the API beside it) in front of the engine `service` shares until
    Ctrl-C."""
    from lvx_ui.app import build_app  # gradio takes seconds to import: bad options fail first

    demo = build_app(service, config, allow_paths=folders)
    serve = config.serve
    demo.queue(max_size=serve.queue_size, default_concurrency_limit=1)
    if serve.host not in LOOPBACK and serve.auth is None and not serve.api_key:
        console.print(
            f"[yellow]warning:[/yellow] serving on {serve.host} without --auth; anyone who can"
            " reach this port can use the model and read the allowed folders"
        )
    app, url, share_url = demo.launch(
        server_name=serve.host,
        server_port=serve.port,
        share=serve.share,
        auth=page_login(serve),
        show_error=True,
        quiet=True,
        prevent_thread_lock=True,
        ssr_mode=False,
        footer_links=[],
        **demo.lvx_launch,
    )
    _api(service, config, folders, uploads, console).mount(app)
    console.print(f"lvx serve: ready on {url}" + (f" (public: {share_url})" if share_url else ""))
    console.print(f"OpenAI-compatible API: {url.rstrip('/')}/v1")
    console.print("[dim]Ctrl-C stops the server and the worker group.[/dim]")
    try:
        console.print(f"lvx serve: stopped by {_wait_for_a_stop_signal()}")
    finally:
        demo.close()
