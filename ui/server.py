"""`lvx serve`: open the engine once, share it through one engine service between the browser chat
and the OpenAI-compatible API (the API alone with --no-ui), close it on exit."""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from lvx_app.config import LOOPBACK, Config, ServeConfig
from lvx_app.engine.describe import one_line
from lvx_app.engine.records import EngineError
from lvx_app.runtime.open import open_engine
from lvx_app.runtime.service import EngineService

GRADIO_TEMP_DIR = "GRADIO_TEMP_DIR"  # where gradio keeps uploads (read when a page is built)
NO_SCHEMA = {"docs_url": None, "redoc_url": None, "openapi_url": None}  # FastAPI's own pages


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
        config = with_memory_limits(config, console)
        _stop_on_sigterm()
        health = Health()
        with _listening(config, health, console) as api_server:
            engine = open_engine(config, console)  # meanwhile /health answers 503 "starting"
            service = EngineService(
                engine,
                reopen=lambda: open_engine(config),
                queue_size=config.serve.queue_size,
                report=lambda line: console.print(f"lvx serve: {one_line(line)}", markup=False),
                stuck_after=config.serve.queue_timeout,  # silent longer than a request may wait
            )
            try:
                _serve(service, config, folders, console, health, api_server)
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


def with_memory_limits(config: Config, console: Console) -> Config:
    """`config` with the requests' memory budgets stated (those not given: shares of this
    machine's memory), said in one line: the page and the API read the same numbers."""
    from lvx_ui.request_memory import MemoryLimits

    limits = MemoryLimits.of(config.serve)
    console.print(f"lvx serve: {limits.describe()}")
    serve = replace(
        config.serve,
        max_upload_mb=limits.upload_mb,
        request_memory_mb=limits.request_mb,
        requests_memory_mb=limits.all_mb,
    )
    return replace(config, serve=serve)


class Health:
    """`GET /health` from the moment the port is open: 503 "starting" while the model loads (so a
    probe tells "not yet" from a wrong URL's 404), then the API's own answer (200 "ok", or 503
    "restarting" while a dead group is replaced)."""

    def __init__(self) -> None:
        self.api_health: Callable[[Any], Awaitable[Any]] | None = None  # set once the API serves

    def route(self):
        """The route, for any FastAPI app (the first /health route of an app is the one served)."""
        from fastapi import Request
        from fastapi.responses import JSONResponse
        from fastapi.routing import APIRoute

        async def health(request: Request) -> JSONResponse:
            if self.api_health is None:
                return JSONResponse(
                    {"status": "starting"}, status_code=503, headers={"Retry-After": "2"}
                )
            return await self.api_health(request)

        health.__annotations__["request"] = Request  # the module defers its annotations

        return APIRoute("/health", health, methods=["GET"])


class _ApiServer:
    """A FastAPI app under uvicorn in a thread (signals stay with the main thread). The port it
    opens stays open: the API and the page are mounted into this app once the model is loaded."""

    def __init__(self, config: Config, health: Health) -> None:
        import uvicorn
        from fastapi import FastAPI

        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self.on_stop = AsyncExitStack()  # closed on the server's loop when it stops
        self.page: Any = None  # gradio's app, once the page is mounted

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            async with self.on_stop:
                yield

        self.app = FastAPI(title="lvx", lifespan=lifespan, **NO_SCHEMA)
        self.app.router.routes.append(health.route())
        serve = config.serve
        self.where = f"{serve.host}:{serve.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=serve.host,
                port=serve.port,
                log_level="warning",
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError(f"could not listen on {self.where}")
            time.sleep(0.05)

    def mount_page(self, demo: Any, **options: Any) -> None:
        """Serve gradio's page `demo` at `/` of this app, beside the routes it has (mount them
        first: the page's mount takes every path after them), and start what gradio starts with
        its server (its queue), on this server's loop; they stop with the server."""
        import gradio as gr

        gr.mount_gradio_app(self.app, demo, "/", **options)
        page = self.app.router.routes[-1].app  # the mount just added

        async def start() -> None:
            await self.on_stop.enter_async_context(page.router.lifespan_context(page))
            demo.run_startup_events()
            await demo.run_extra_startup_events()

        assert self.loop is not None, "the server runs before a page is mounted"
        asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.page = page

    def stop(self) -> None:
        if self.page is not None and self.loop is not None:
            # the page's open event streams end now, not cancelled at the end of the grace period
            self.loop.call_soon_threadsafe(self.page.stop_event.set)
        self.server.should_exit = True
        self.thread.join()


@contextmanager
def _listening(config: Config, health: Health, console: Console) -> Iterator[_ApiServer]:
    """The port open from the start, answering /health while the model loads; this server goes on
    to serve the API and the page (only a page with --share gets gradio's own server, which
    takes the port over once the model is loaded)."""
    server = _ApiServer(config, health)
    server.start()
    try:
        yield server
    finally:
        if server.thread.is_alive():
            server.stop()


def _api(
    service: EngineService, config: Config, folders: list[str], uploads: str, console: Console
):
    """The OpenAI-compatible API on the engine `service` shares; data: URL videos go to
    `uploads`."""
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

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


def _serve(
    service: EngineService,
    config: Config,
    folders: list[str],
    console: Console,
    health: Health,
    api_server: _ApiServer,
) -> None:
    with tempfile.TemporaryDirectory(prefix="lvx-api-videos-") as uploads:
        api = _api(service, config, folders, uploads, console)
        if config.serve.no_ui:
            _serve_api_alone(api, config, console, health, api_server)
        else:
            with _page_uploads_in(Path(uploads) / "page"):
                _serve_page(service, api, config, folders, console, health, api_server)


@contextmanager
def _page_uploads_in(folder: Path) -> Iterator[None]:
    """Gradio keeps the page's uploads in GRADIO_TEMP_DIR (by default a `gradio` folder in the
    temporary folder, never emptied): here, in the server's own temporary folder, removed when the
    server stops however it is stopped. A GRADIO_TEMP_DIR the user set is theirs and kept."""
    given = os.environ.get(GRADIO_TEMP_DIR)
    if given:
        yield
        return
    os.environ[GRADIO_TEMP_DIR] = str(folder)
    try:
        yield
    finally:
        os.environ.pop(GRADIO_TEMP_DIR, None)


def _serve_api_alone(
    api, config: Config, console: Console, health: Health, api_server: _ApiServer
) -> None:
    """The API alone under uvicorn (no gradio) until Ctrl-C; a dead group is restarted by the next
    request."""
    api.mount(api_server.app)
    health.api_health = api.health
    serve = config.serve
    name = f"[{serve.host}]" if ":" in serve.host else serve.host
    console.print(f"lvx serve: ready on http://{name}:{serve.port}/ (the API at /v1, no page)")
    console.print("[dim]Ctrl-C stops the server and the worker group.[/dim]")
    stopped_by = _wait_for_a_stop_signal(api_server.thread.is_alive)
    api_server.stop()
    if stopped_by:
        console.print(f"lvx serve: stopped by {stopped_by}")


def _warn_if_open(serve, console: Console) -> None:
    """One line when the page is reachable beyond this machine without a login."""
    if serve.host not in LOOPBACK and serve.auth is None and not serve.api_key:
        console.print(
            f"[yellow]warning:[/yellow] serving on {serve.host} without --auth; anyone who can"
            " reach this port can use the model and read the allowed folders"
        )


def _serve_page(
    service: EngineService,
    api,
    config: Config,
    folders: list[str],
    console: Console,
    health: Health,
    api_server: _ApiServer,
) -> None:
    """Put the page (and the API beside it) in front of the engine `service` shares until
    Ctrl-C. The page is built while the first server answers /health, then mounted into it, so
    the port never closes; only --share launches gradio's own server (its share link comes with
    it), which takes the port over at the launch."""
    from starlette.middleware import Middleware

    from lvx_ui.app import build_app  # gradio takes seconds to import: bad options fail first
    from lvx_ui.page_files import RegularFilesOnly

    demo = build_app(service, config, allow_paths=folders)
    serve = config.serve
    demo.queue(max_size=serve.queue_size, default_concurrency_limit=1)
    _warn_if_open(serve, console)
    options = dict(
        auth=page_login(serve),
        show_error=True,
        ssr_mode=False,
        footer_links=[],
        # no schema of the routes (nor its pages): the API is OpenAI's, documented there, and
        # FastAPI's schema of these routes cannot be built
        app_kwargs={"middleware": [Middleware(RegularFilesOnly)], **NO_SCHEMA},  # no FIFO behind
        **demo.lvx_launch,
    )
    share_url = None
    if serve.share:
        api_server.stop()  # gradio's server takes the port over
        options["app_kwargs"]["routes"] = [health.route()]  # /health answers from the first moment
        app, url, share_url = demo.launch(
            server_name=serve.host,
            server_port=serve.port,
            share=True,
            quiet=True,
            prevent_thread_lock=True,
            **options,
        )
        api.mount(app)
    else:
        api.mount(api_server.app)  # before the page: its mount takes every path after it
        api_server.mount_page(demo, server_name=serve.host, server_port=serve.port, **options)
        name = f"[{serve.host}]" if ":" in serve.host else serve.host
        url = f"http://{name}:{serve.port}/"
    health.api_health = api.health
    console.print(f"lvx serve: ready on {url}" + (f" (public: {share_url})" if share_url else ""))
    console.print(f"OpenAI-compatible API: {url.rstrip('/')}/v1")
    console.print("[dim]Ctrl-C stops the server and the worker group.[/dim]")
    try:
        console.print(f"lvx serve: stopped by {_wait_for_a_stop_signal()}")
    finally:
        demo.close()
