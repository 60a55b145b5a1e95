"""The OpenAI-compatible API of `lvx serve`: `GET /v1/models`, `POST /v1/chat/completions` (one
JSON answer, or server-sent events: `data: {chunk}` ... `data: [DONE]`) and `GET /health`, on the
page's port and engine (or alone, `--no-ui`).

One engine holds one video and one conversation, so a request is a client of the engine service
(`lvx_app.runtime.service`) with the page's tabs: it waits in the service's queue (at most
--queue-size wait, more get 429), loads the video it names when the engine holds another (or the
same one opened differently), and hands the whole `messages` array to `Engine.chat`: the ranks keep
the longest prefix of its tokens they hold and prefill only the rest, so a follow-up costs its new
tokens (`usage.prompt_tokens_details.cached_tokens` says how many were reused). A worker group found
dead answers 503 while the service restarts it. A client that goes away mid-stream stops its
answer: the ranks finish the step they are in; one gone while it waited is not answered.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from lvx_app.config import Config, ConfigError, VideoConfig, frontend_words, updated
from lvx_app.engine.describe import one_line, shortened
from lvx_app.engine.records import (
    AnswerStats,
    EngineError,
    GroupFailed,
    QuestionTooLong,
    VideoRequest,
    VideoSummary,
)
from lvx_app.runtime.service import Busy, EngineService, Lease, Restarting
from lvx_app.speech.choice import speech_available
from lvx_models.api import checkpoint_folder, family_of
from lvx_ui.bounded_stream import BoundedStreamingResponse
from lvx_ui.openai_request import (
    ApiError,
    ChatRequest,
    VideoAsk,
    VideoFiles,
    bad,
    read_request,
    sent_as_frames,
)
from lvx_ui.request_body import read_body
from lvx_ui.request_memory import MemoryLimits, RequestMemory, Reservation
from lvx_ui.subtitle_fields import evidence_field, subtitles_field

log = logging.getLogger("lvx.api")
LEFT = "the client went away"  # why an answer stopped early
CLIENT = "api"  # the service's client id of every API request: it keeps no video or turns


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
    """An answer being generated; it holds the engine's lease until `close`, which reports one
    line about it and gives the lease back."""

    def __init__(
        self,
        lease: Lease,
        pieces: Iterator[str],
        stops: StopStrings,
        report: Callable[[str], None],
        done: Callable[[], None] = lambda: None,
    ) -> None:
        self.lease, self.pieces, self.stops, self.report = lease, pieces, stops, report
        self.done = done  # after the lease is given back: the request's upload may go
        self.closed, self.why, self.stats = False, "", AnswerStats()
        self.about = ""  # the video's name (or "frames"), for the log line
        self.evidence_asked = False
        self.video: VideoSummary | None = None  # the loaded video the request named (None: none)
        self.loaded_now = 0  # prompt tokens this request's own load prefilled
        self.pieces_out = 0  # pieces the engine gave (an answer stopped early may have no stats)
        self._texts = self._cut()
        self.first = self.next()

    def _cut(self) -> Iterator[str]:
        for piece in self.pieces:
            self.pieces_out += 1
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
            self.stats = self.lease.engine.last_answer or AnswerStats()  # before another answer's
            self.report(self.line())
        finally:
            self.lease.close()
            self.done()

    @property
    def frames(self) -> int | None:
        """The frames of the video the answer is about (None: no video named)."""
        return self.video.frames if self.video is not None else None

    def extension(self) -> dict[str, Any]:
        """`lvx_subtitles` (where the video's subtitles came from, how many lines were placed)
        when the request named a video; `lvx_evidence` (each moment's start, end and share, and
        what the transcript says there) when the request asked for it."""
        out: dict[str, Any] = {}
        if self.video is not None:
            out["lvx_subtitles"] = subtitles_field(self.video, self.stats)
        if self.evidence_asked:
            transcript = self.video.transcript if self.video is not None else []
            out["lvx_evidence"] = evidence_field(self.stats.evidence or [], transcript)
        return out

    @property
    def finish_reason(self) -> str:
        return "length" if self.stats.truncated and not self.stops.hit else "stop"

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens reused from before this request: neither prefilled by the answer nor
        by this request's own load of the video."""
        s = self.stats
        return max(0, s.prompt_tokens - s.prefill_tokens - self.loaded_now)

    def usage(self) -> dict[str, Any]:
        s = self.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.new_tokens,
            "total_tokens": s.prompt_tokens + s.new_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **({"frames": self.frames} if self.frames is not None else {}),  # lvx's own field
        }

    def line(self) -> str:
        """One line for the server's log."""
        s = self.stats
        ended = f", stopped: {self.why}" if self.why else ""
        if self.why and not s.new_tokens and self.pieces_out:  # stopped before its stats were made
            ended += f" after {self.pieces_out} pieces"
        video = "no video"
        if self.frames is not None:
            video = f"video {self.about} ({self.frames} frames)"
        return (
            f"api: {s.new_tokens} tokens, TTFT {s.ttft_s:.2f} s, prefilled {s.prefill_tokens} of "
            f"{s.prompt_tokens} prompt tokens, {video}{ended}"
        )


def evidence_override(req: ChatRequest, config: Config) -> dict[str, bool]:
    """The answer's evidence is made only when the request asks and the server's --evidence is on:
    a plain OpenAI client's answer costs nothing extra."""
    return {"evidence": req.evidence and config.generation.evidence}


# What the subtitle errors tell a terminal user to type, and what an API client sends instead
API_WORDS = (
    ("--subtitles none", '"subtitles": "none"'),
    ("--subtitles auto", '"subtitles": "auto"'),
    ("--subtitles FILE", '"subtitles": a file under the allowed folders'),
)


def for_the_api(message: str) -> str:
    """An engine error's advice in the request's words (its fields, not the command's flags)."""
    for cli, api in API_WORDS:
        message = message.replace(cli, api)
    return message


def api_error(exc: BaseException) -> ApiError:
    """An engine failure as the client sees it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), "queue_full")
    if isinstance(exc, Restarting):
        return ApiError(503, str(exc), "restarting")
    if isinstance(exc, GroupFailed):
        return ApiError(503, f"{exc}; the workers are restarting, try again shortly", "restarting")
    if isinstance(exc, QuestionTooLong):
        return ApiError(400, str(exc), "context_length_exceeded", "messages")
    if isinstance(exc, EngineError):
        return bad(for_the_api(str(exc)))
    log.exception("request failed")
    return ApiError(500, f"{type(exc).__name__}: {exc} (details in the server log)", "internal")


def model_context(config: Config) -> int | None:
    """The checkpoint's `max_position_embeddings` (its config.json, already fetched by the engine);
    None when it cannot be read."""
    try:
        folder = checkpoint_folder(config.model.path, config.model.revision)
        family = family_of(folder)
        return int(family.read_config(folder).max_position_embeddings)
    except Exception:  # noqa: BLE001 - the engine has read it; without it no bound is added
        return None


def error_response(err: ApiError) -> JSONResponse:
    retry = {"Retry-After": "2"} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=retry)


def refusal_line(err: ApiError, what: str) -> str:
    """`api: 127.0.0.1:50312 "POST /v1/chat/completions" 429 queue_full: the queue is full...`"""
    return f"api: {what} {err.status} {err.code}: {shortened(err.message, 200)}"


def lvx_fields(video: VideoConfig, loaded: VideoSummary | None) -> dict[str, Any]:
    """lvx's own fields of /v1/models: what a request that sets no video option gets, the visual
    K/V mode of the video the engine holds and why, and whether "subtitles": "speech" (and auto
    without subtitles) can transcribe, and with what."""
    return {
        "lvx_video_defaults": {
            "fps": video.fps,
            "max_frames": video.max_frames or 0,
            "subtitles": video.subtitles,
        },
        "lvx_kv_mode": {"asked": video.kv_mode, "last load": loaded.kv_choice if loaded else {}},
        "lvx_speech": {"available": speech_available(), "model": video.speech_model},
    }


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def video_name(ask: VideoAsk | None, request: VideoRequest | None) -> str:
    """What the log calls a request's video: its file's name, "frames" for frames sent as images,
    "a video sent" for one sent in the body."""
    if ask is None or request is None:
        return ""
    if sent_as_frames(ask.url):
        return "frames"
    return "a video sent" if ask.url.startswith("data:") else Path(request.path).name


class OpenAIApi:
    """The routes and what they do with the engine `service` shares."""

    def __init__(
        self, service: EngineService, config: Config, files: VideoFiles, report=None
    ) -> None:
        self.service, self.config, self.files = service, config, files
        said = report or log.info
        self.report: Callable[[str], None] = lambda line: said(one_line(line))  # client text too
        self.model_id, self.created = config.model.path, int(time.time())
        self.context = model_context(config)  # the model's positions: no answer is longer
        self.memory = RequestMemory(MemoryLimits.of(config.serve))  # what requests may take
        # the waiting requests, the one answering, and room for the routes' short calls
        self._threads = anyio.CapacityLimiter(config.serve.queue_size + 8)

    def mount(self, app: FastAPI) -> None:
        """Add `/v1` and `/health` to `app` (also to a Gradio app that already serves)."""
        v1 = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        v1.add_api_route("/models", self.models, methods=["GET"])
        v1.add_api_route("/chat/completions", self.completions, methods=["POST"])
        app.mount("/v1", v1)
        app.add_api_route("/health", self.health, methods=["GET"])

    # ---- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        """Whether the engine answers (503 while its worker group is dead or restarting, a rank
        killed between requests included); the model's path only to a client that holds the
        key."""
        down = self.service.down()
        if down is not None:
            return JSONResponse({"status": down}, status_code=503, headers={"Retry-After": "2"})
        try:
            self._check_key(request)
        except ApiError:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._check_key(request)
        except ApiError as err:
            return self._refused(err, request)
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lvx"}
        model |= lvx_fields(self.config.video, self.service.loaded)
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        held = self.memory.reserve()  # the request's memory, given back when it ends
        try:
            self._check_key(request)
            req = read_request(await self._body(request, held))
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()),
                "model": self.model_id,
            }
            client = self._client_id(request, req.user)

            def gone() -> bool:  # whether the client has left (asked from the worker thread)
                return anyio.from_thread.run(request.is_disconnected)

            answer = await self._in_thread(self._begin, req, client, gone, held)
            if not req.stream:
                return JSONResponse(await self._whole(answer, head, request))
        except ApiError as err:
            held.close()
            return self._refused(err, request)
        except BaseException:
            held.close()
            raise
        wait = self.config.serve.send_timeout

        def stalled() -> None:  # the stream's `finally` reports the answer with this reason
            answer.why = f"the client read nothing for {wait:g} s (--send-timeout)"

        return BoundedStreamingResponse(
            self._events(answer, req, head),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            # runs after the stream in any case (also when the client left before it began)
            background=BackgroundTask(self._in_thread, answer.close, LEFT),
            send_timeout=wait,
            stalled=stalled,
        )

    def _refused(self, err: ApiError, request: Request) -> JSONResponse:
        """The error response, and its line in the server's log: every refused request is seen
        there, as in an access log."""
        where = request.client
        client = f"{where.host}:{where.port}" if where else "?"
        err.message = self.files.unnamed(err.message)  # the client never sees the upload folder
        self.report(refusal_line(err, f'{client} "{request.method} {request.url.path}"'))
        return error_response(err)

    # ---- the request
    # ----------------------------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        key = self.config.serve.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("latin-1"), key.encode()
        ):
            raise ApiError(
                401,
                "this server needs its API key: send Authorization: Bearer KEY (the key given "
                "with --api-key or LVX_API_KEY)",
                "invalid_api_key",
            )

    @staticmethod
    def _client_id(request: Request, user: str) -> str:
        """The engine service's client a request belongs to: its key and its `user` field. Clients
        never reuse each other's conversations, so the cached count tells nobody another's."""
        who = request.headers.get("authorization", "") + "\0" + user
        return CLIENT + ":" + hashlib.sha256(who.encode("utf-8", "replace")).hexdigest()[:16]

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker thread of the API's own: requests waiting for the engine hold
        one each, so the queue, not the thread pool, decides who waits."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    async def _body(self, request: Request, held: Reservation) -> Any:
        """The JSON body, read no further than the upload limit allows (a chunked body too), its
        memory reserved in `held` before it is read."""
        limit = self.files.max_upload_mb * 2**20 * 4 / 3 + 2**20  # base64, and the rest
        return await read_body(request, limit, held, self.files.too_large)

    def _begin(
        self, req: ChatRequest, client: str, gone: Callable[[], bool], reserved: Reservation
    ) -> Answer:
        """(In a worker thread.) Make the request's video file (its memory in `reserved`), wait
        for the engine, load the video if the engine holds another, start the answer and
        take its first text: errors so far get their own status. A client `gone` by its turn (a
        harness's timeout, its retry queued behind) is not answered. While it waits, the request
        holds in `reserved` only what it keeps (its turns), not what its body took."""
        longest = req.generation.get("max_new_tokens", 0)
        if self.context and longest > self.context:
            why = f"max_tokens must be at most {self.context}, the model's context (its positions)"
            raise bad(why, "max_tokens")
        ask = req.video
        request = self._request(ask, client, reserved) if ask is not None else None
        about = video_name(ask, request)
        req.video = ask = None  # a data: URL is the body's bulk: its file is made, the text goes
        reserved.keep(4 * sum(len(t["content"]) for t in req.turns))
        release = (lambda: self.files.release(request.path)) if request else (lambda: None)
        try:
            lease = self.service.lease(
                client, on_dead="refuse", timeout=self.config.serve.queue_timeout
            )
        except EngineError as exc:  # 429: the queue is full; 503: the group restarts
            release()
            raise api_error(exc) from None
        if gone():
            lease.close()
            release()
            self.report(f"api: not answered, {LEFT} while it waited")
            raise ApiError(499, LEFT, "client_closed")
        generation = {**req.generation, **evidence_override(req, self.config)}
        held = self.service.loaded
        try:
            pieces = lease.chat(request, req.turns, **generation)
        except BaseException as exc:
            lease.close()
            release()
            raise api_error(exc) from None

        def done() -> None:  # after the lease: the upload may go, the memory is given back
            release()
            reserved.close()

        answer = Answer(lease, pieces, StopStrings(req.stop), self.report, done)
        loaded = self.service.loaded
        answer.video = loaded if request is not None else None
        answer.about = about
        answer.evidence_asked = req.evidence
        if loaded is not None and loaded is not held and not loaded.prompt_from_cache:
            answer.loaded_now = loaded.prompt_tokens  # prefilled for this request: not reused
        return answer

    def _request(self, ask: VideoAsk, client: str, held: Reservation) -> VideoRequest:
        """The load the request asks for: its video file, the video options it sets (checked as
        the command line's are; the API names them by field) and a subtitle file under
        --allow-paths. Its opening's words are `client`'s: reused for no other client."""
        options = dict(ask.options)
        if sent_as_frames(ask.url):
            options.setdefault("fps", 1.0)  # frames sent without a rate: one a second
        try:
            video = updated(self.config.video, by="api", **options)
        except ConfigError as exc:
            raise bad(*frontend_words(str(exc), VideoConfig, "api")) from None
        video = replace(video, subtitles=self.files.subtitles(video.subtitles))
        opening = ask.opening.owned_by(client)
        return VideoRequest(self.files.video(ask.url, video.fps, held), video, opening=opening)

    # ---- the answer
    # ----------------------------------------------------------------------------------------------
    async def _whole(self, answer: Answer, head: dict, request: Request) -> dict[str, Any]:
        """The whole answer as one chat.completion; a client that left stops it."""
        parts, text = [], answer.first
        try:
            while text is not None:
                parts.append(text)
                if await request.is_disconnected():
                    answer.why = LEFT
                    break
                text = await self._in_thread(answer.next)
        finally:
            with anyio.CancelScope(shield=True):
                await self._in_thread(answer.close, answer.why)
        message = {"role": "assistant", "content": "".join(parts)}
        choice = {"index": 0, "message": message, "logprobs": None}
        return {
            **head,
            "object": "chat.completion",
            "choices": [{**choice, "finish_reason": answer.finish_reason}],
            "usage": answer.usage(),
            **answer.extension(),
        }

    async def _events(self, answer: Answer, req: ChatRequest, head: dict) -> AsyncIterator[str]:
        """The answer as server-sent events; the client leaving (cancellation) stops it."""
        head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta: dict, finish: str | None = None, **more: Any) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra, **more})

        try:
            yield chunk({"role": "assistant", "content": ""})
            text = answer.first
            while text is not None:
                yield chunk({"content": text})
                text = await self._in_thread(answer.next)
            await self._in_thread(answer.close)
            yield chunk({}, answer.finish_reason, **answer.extension())
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": answer.usage()})
        except ApiError as err:  # the headers are sent: the error is the stream's last event
            err.message = self.files.unnamed(err.message)
            self.report(refusal_line(err, "the stream of an answer"))
            yield sse(err.body())
        finally:
            if not answer.closed:
                with anyio.CancelScope(shield=True):
                    await self._in_thread(answer.close, answer.why or LEFT)
        yield "data: [DONE]\n\n"
