"""The OpenAI-compatible API of `lvx serve`: `GET /v1/models`, `POST /v1/chat/completions` (one
JSON answer, or server-sent events: `data: {chunk}` ... `data: [DONE]`) and `GET /health`, on the
page's port and engine (or alone, `--no-ui`).

One engine holds one video and one conversation, so a request waits for the engine with the page's
requests (their lock; at most --queue-size API requests wait, more get 429), loads the video it
names when the engine holds another (or the same one opened differently), and hands the whole
`messages` array to `Engine.chat`: the ranks keep the longest prefix of its tokens they hold and
prefill only the rest, so a follow-up costs its new tokens (`usage.prompt_tokens_details.
cached_tokens` says how many were reused). A worker group found dead answers 503 while it restarts.
A client that goes away mid-stream stops its answer: the ranks finish the step they are in.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lvx_app.config import Config, ConfigError, updated
from lvx_app.engine.api import AnswerStats, EngineError, GroupFailed, QuestionTooLong
from lvx_app.runtime.engine_handle import Engine
from lvx_ui.openai_request import ApiError, ChatRequest, VideoAsk, VideoFiles, bad, read_request

log = logging.getLogger("lvx.api")
LEFT = "the client went away"  # why an answer stopped early


class EngineHost(Protocol):
    """Who holds the engine: the page's `SharedEngine`, or `SoleEngine` with --no-ui."""

    lock: threading.Lock
    engine: Engine

    def lend(self) -> Engine:
        """With `lock` held: the engine, its group restarted first if it died."""
        ...


class SoleEngine:
    """The engine when the API is served alone: one lock, a dead group restarted by `lend`."""

    def __init__(self, engine: Engine, reopen: Callable[[], Engine]) -> None:
        self.engine, self.reopen, self.lock = engine, reopen, threading.Lock()

    def lend(self) -> Engine:
        if self.engine.dead():
            with contextlib.suppress(Exception):
                self.engine.close()
            self.engine = self.reopen()
        return self.engine

    def close(self) -> None:
        self.engine.close()


class StopStrings:
    """Cuts an answer at the first of the request's `stop` strings; text that may be the start of
    one is held back until the next piece tells."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.hit = stops, "", False

    def push(self, piece: str) -> str:
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[: min(found)]
        keep = max(
            (k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Answer:
    """An answer being generated; it holds the engine (the lock) until `close`, which reports one
    line about it."""

    def __init__(
        self,
        engine: Engine,
        pieces: Iterator[str],
        stops: StopStrings,
        release: Callable[[], None],
        report: Callable[[str], None],
    ) -> None:
        self.engine, self.pieces, self.stops = engine, pieces, stops
        self.release, self.report = release, report
        self.closed, self.why, self.stats = False, "", AnswerStats()
        self._texts = self._cut()
        self.first = self.next()

    def _cut(self) -> Iterator[str]:
        for piece in self.pieces:
            text = self.stops.push(piece)
            if text:
                yield text
            if self.stops.hit:
                return
        tail = self.stops.flush()
        if tail:
            yield tail

    def next(self) -> str | None:
        """The next text to send, None at the end; an engine error closes the answer and comes as
        an ApiError."""
        try:
            return next(self._texts, None)
        except Exception as exc:
            self.close("failed")
            raise api_error(exc) from None

    def close(self, why: str = "") -> None:
        """Stop the answer if it is still running (the ranks finish their step), free the engine."""
        if self.closed:
            return
        self.closed, self.why = True, why or ("a stop string" if self.stops.hit else "")
        try:
            with contextlib.suppress(Exception):  # a dead group has nothing left to drain
                self.pieces.close()
            self.stats = self.engine.last_answer or AnswerStats()  # before another answer's
            self.report(self.line())
        finally:
            self.release()

    @property
    def finish_reason(self) -> str:
        return "length" if self.stats.truncated and not self.stops.hit else "stop"

    def usage(self) -> dict[str, Any]:
        s = self.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens,
            "prompt_tokens_details": {"cached_tokens": s.prompt_tokens - s.prefill_tokens},
        }

    def line(self) -> str:
        """One line for the server's log."""
        s = self.stats
        ended = f", stopped: {self.why}" if self.why else ""
        return (
            f"api: {s.new_tokens} tokens, TTFT {s.ttft_s:.2f} s, prefilled {s.prefill_tokens} of "
            f"{s.prompt_tokens} prompt tokens{ended}"
        )


def api_error(exc: BaseException) -> ApiError:
    """An engine failure as the client sees it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, GroupFailed):
        return ApiError(503, f"{exc}; the workers are restarting, try again shortly", "restarting")
    if isinstance(exc, QuestionTooLong):
        return ApiError(400, str(exc), "context_length_exceeded", "messages")
    if isinstance(exc, EngineError):
        return bad(str(exc))
    log.exception("request failed")
    return ApiError(500, f"{type(exc).__name__}: {exc} (details in the server log)", "internal")


def error_response(err: ApiError) -> JSONResponse:
    retry = {"Retry-After": "2"} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=retry)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class OpenAIApi:
    """The routes and what they do with the engine `host` holds."""

    def __init__(self, host: EngineHost, config: Config, files: VideoFiles, report=None) -> None:
        self.host, self.config, self.files = host, config, files
        self.report: Callable[[str], None] = report or log.info
        self.model_id, self.created = config.model.path, int(time.time())
        self.waiting, self._count = 0, threading.Lock()
        self.restarting = threading.Event()

    def mount(self, app: FastAPI) -> None:
        """Add `/v1` and `/health` to `app` (also to a Gradio app that already serves)."""
        v1 = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        v1.add_api_route("/models", self.models, methods=["GET"])
        v1.add_api_route("/chat/completions", self.completions, methods=["POST"])
        app.mount("/v1", v1)
        app.add_api_route("/health", self.health, methods=["GET"])

    # ---- routes
    # ----------------------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        if self.restarting.is_set():
            return JSONResponse({"status": "restarting"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._check_key(request)
        except ApiError as err:
            return error_response(err)
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lvx"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        try:
            self._check_key(request)
            req = read_request(await self._body(request))
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()),
                "model": self.model_id,
            }
            answer = await anyio.to_thread.run_sync(self._begin, req)
            if not req.stream:
                return JSONResponse(await anyio.to_thread.run_sync(self._whole, answer, head))
        except ApiError as err:
            return error_response(err)
        return StreamingResponse(
            self._events(answer, req, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            # runs after the stream in any case (also when the client left before it began)
            background=BackgroundTask(anyio.to_thread.run_sync, answer.close, LEFT),
        )

    # ---- the request
    # ----------------------------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        key = self.config.serve.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), key.encode()
        ):
            raise ApiError(
                401,
                "this server needs its API key: send Authorization: Bearer KEY (the key given "
                "with --api-key or LVX_API_KEY)",
                "invalid_api_key",
            )

    async def _body(self, request: Request) -> Any:
        limit = self.config.serve.max_upload_mb * 2**20
        size = int(request.headers.get("content-length", "0").strip() or 0)
        if size * 3 / 4 > limit + 2**20:  # base64 takes 4 bytes for 3, and room for the rest
            async for _ in request.stream():  # read, not kept: the client then reads the answer
                pass
            self.files.too_large(size * 3 / 4)
        try:
            return json.loads(await request.body())
        except ValueError:
            raise bad("the body is not valid JSON") from None

    def _begin(self, req: ChatRequest) -> Answer:
        """(In a worker thread.) Wait for the engine, load the request's video if the engine holds
        another, start the answer and take its first text: errors so far get their own status."""
        video = self._resolve(req.video) if req.video is not None else None
        engine = self._take_engine()
        try:
            if video is not None:
                self._load(engine, *video)
            pieces = engine.chat(req.turns, **req.generation)
        except BaseException as exc:
            self.host.lock.release()
            raise self._failed(exc) from None
        try:
            stops = StopStrings(req.stop)
            return Answer(engine, pieces, stops, self.host.lock.release, self.report)
        except ApiError as err:
            raise self._failed(err) from None

    def _resolve(self, ask: VideoAsk) -> tuple[str, VideoAsk]:
        """(the video file, the request's video with its subtitle file checked)."""
        path = self.files.video(ask.url)
        options = dict(ask.options)
        if "subtitles" in options:
            options["subtitles"] = self.files.subtitles(options["subtitles"])
        return path, VideoAsk(ask.url, ask.opening, options)

    def _take_engine(self) -> Engine:
        """The engine, with the lock held: 429 when too many wait, 503 while the group restarts."""
        if self.restarting.is_set():
            raise ApiError(503, "the worker group is restarting; try again shortly", "restarting")
        if not self.host.lock.acquire(blocking=False):
            self._wait_for(self.host.lock)
        why = self.host.engine.dead()
        if why:
            self.host.lock.release()
            raise self._failed(GroupFailed(why))
        try:
            return self.host.lend()
        except Exception as exc:  # the group died and could not be started again
            self.host.lock.release()
            raise self._failed(GroupFailed(str(exc))) from None

    def _wait_for(self, lock: threading.Lock) -> None:
        """Wait for the engine behind the request using it, unless --queue-size requests wait."""
        with self._count:
            if self.waiting >= self.config.serve.queue_size:
                raise ApiError(
                    429,
                    f"the server is busy ({self.waiting} requests wait); try again shortly",
                    "queue_full",
                )
            self.waiting += 1
        try:
            lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1

    def _load(self, engine: Engine, path: str, ask: VideoAsk) -> None:
        """Load the video unless the engine holds it, opened the same way."""
        try:
            wanted = updated(engine.config.video, **ask.options)
        except ConfigError as exc:
            raise bad(str(exc)) from None
        if engine.held_video != (path, wanted, None, ask.opening):
            engine.load_video(path, opening=ask.opening, **ask.options)

    def _failed(self, exc: BaseException) -> ApiError:
        """`exc` for the client; a dead group starts restarting in the background."""
        err = api_error(exc)
        if err.code == "restarting" and not self.restarting.is_set():
            self.restarting.set()
            threading.Thread(target=self._restart, args=(str(exc),), daemon=True).start()
        return err

    def _restart(self, why: str) -> None:
        try:
            with self.host.lock:
                self.host.lend()
            self.report(f"api: the worker group restarted after: {why}")
        except Exception as exc:  # noqa: BLE001 - the next request tries again
            self.report(
                f"api: the worker group could not restart ({exc}); the next request retries"
            )
        finally:
            self.restarting.clear()

    # ---- the answer
    # ----------------------------------------------------------------------------------------------
    def _whole(self, answer: Answer, head: dict) -> dict[str, Any]:
        """(In a worker thread.) The whole answer as one chat.completion."""
        parts, text = [], answer.first
        try:
            while text is not None:
                parts.append(text)
                text = answer.next()
        except ApiError as err:
            raise self._failed(err) from None
        finally:
            answer.close()
        message = {"role": "assistant", "content": "".join(parts)}
        choice = {"index": 0, "message": message, "logprobs": None}
        return {
            **head,
            "object": "chat.completion",
            "choices": [{**choice, "finish_reason": answer.finish_reason}],
            "usage": answer.usage(),
        }

    async def _events(self, answer: Answer, req: ChatRequest, head: dict) -> AsyncIterator[str]:
        """The answer as server-sent events; the client leaving (cancellation) stops it."""
        head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta: dict, finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        try:
            yield chunk({"role": "assistant", "content": ""})
            text = answer.first
            while text is not None:
                yield chunk({"content": text})
                text = await anyio.to_thread.run_sync(answer.next)
            await anyio.to_thread.run_sync(answer.close)
            yield chunk({}, answer.finish_reason)
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": answer.usage()})
        except ApiError as err:  # the headers are sent: the error is the stream's last event
            yield sse(self._failed(err).body())
        finally:
            if not answer.closed:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(answer.close, LEFT)
        yield "data: [DONE]\n\n"
