"""The browser chat: a Gradio Blocks app around any `Engine` (in-process or a torchrun group).

There is one engine and one video per server, so every event that touches the engine (load, chat,
stats) shares one Gradio concurrency slot and leases the engine from the service: requests reach
rank 0 one at a time, in order, and a second user waits in Gradio's queue with a visible position.
Stop does not wait in that queue: it only raises the flag of its own tab, which that tab's
streaming answer checks between tokens.

Each browser tab is a client of the engine service (`lvx_app.runtime.service`), by the id it keeps
in its page state: a tab asks only about the video it loaded itself (a tab without one is asked to
load one), and in its own conversation. When another tab (or the API) used the engine since, its
next question first gets its video back (from the feature cache, with progress) and its
conversation rebuilt from its own turns, and the answer's footer says so; every answer names its
video. A dead worker group is restarted by the next request, which then brings the asking tab back
the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from lvx_app.config import Config, ConfigError, VideoConfig, frontend_words, updated
from lvx_app.engine.describe import (
    describe_answer,
    describe_video,
    placed_line,
    printable,
    shortened,
)
from lvx_app.engine.records import EngineError, GroupFailed, VideoRequest
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.service import Client, EngineService, Lease, NoVideo
from lvx_app.subtitles import SIDECAR_EXTENSIONS
from lvx_app.warning_lines import is_lvx_source
from lvx_ui.chat_history import PageChatbot
from lvx_ui.evidence_view import THUMB_CSS, evidence_markdown
from lvx_ui.openai_request import allowed_path, existing_file
from lvx_ui.transcript_view import transcript_markdown
from lvx_ui.video_picker import allowed_videos

log = logging.getLogger("lvx.ui")

GPU = "gpu"  # the concurrency id every engine event shares
SEEK_PREFIX = "#lvx-seek-"
NO_VIDEO = "load a video in this browser tab first: each tab asks about its own video"
_TIMESTAMP = re.compile(r"(?<![\d:.])(?:(\d{1,2}):)?(\d{1,3}):([0-5]\d)(?![\d:])")

# Clicking an answer's timestamp link seeks the player instead of navigating (installed once per
# page).
SEEK_JS = """
() => {
  if (window.__lvxSeek) return;
  window.__lvxSeek = true;
  document.addEventListener("click", (ev) => {
    const a = ev.target && ev.target.closest ? ev.target.closest("a") : null;
    if (!a) return;
    const m = (a.getAttribute("href") || "").match(/#lvx-seek-(\\d+(?:\\.\\d+)?)$/);
    if (!m) return;
    ev.preventDefault();
    ev.stopPropagation();
    const v = document.querySelector("#lvx-video video");
    if (v) { v.currentTime = parseFloat(m[1]); }
  }, true);
}
"""


def link_timestamps(text: str, duration_s: float | None) -> str:
    """Turn times like 12:34 or 1:02:03 into markdown links that seek the player (only times inside
    the video)."""

    def replace(m: re.Match) -> str:
        hours, minutes, seconds = int(m.group(1) or 0), int(m.group(2)), int(m.group(3))
        if m.group(1) is not None and minutes >= 60:
            return m.group(0)
        at = hours * 3600 + minutes * 60 + seconds
        if duration_s is None or at > duration_s + 1:
            return m.group(0)
        return f"[{m.group(0)}]({SEEK_PREFIX}{at})"

    return _TIMESTAMP.sub(replace, text)


def message_text(content: Any) -> str:
    """The text of a chat message as Gradio hands it back (a string, or a list of typed parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(message_text(part) for part in content)
    return ""


def memory_table(stats: dict[str, Any]) -> str:
    """Per-rank rows of `engine.stats()` as a markdown table."""
    rows = stats.get("ranks") or []
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def answer_footer(engine: Engine) -> str:
    """TTFT, tokens/s and flags of the last answer, worded for the page rather than the command
    line."""
    line = describe_answer(engine.last_answer)
    return line.replace("hit --max-new-tokens", "hit the max new tokens limit")


def answer_evidence(engine: Engine, path: str) -> str:
    """The last answer's moments as thumbnails that seek the player ("" without evidence)."""
    return evidence_markdown(getattr(engine.last_answer, "evidence", None), path, SEEK_PREFIX)


def _text(text: str) -> dict[str, str]:
    """A chat message part shown verbatim."""
    return {"type": "text", "text": text}


def _error(exc: BaseException) -> str:
    """One readable line; engine and option errors are already phrased for the user."""
    if isinstance(exc, (EngineError, ConfigError)):
        return str(exc)
    log.exception("request failed")
    return f"{type(exc).__name__}: {exc} (details in the server log)"


# What the subtitle errors and notes tell a terminal user to type, and what a browser user does
# instead (the page has no flags)
PAGE_WORDS = (
    ("pass an .srt or .vtt file, or --subtitles none", "upload an .srt or .vtt file, or remove it"),
    ("pass --subtitle-encoding, or --subtitles none", "save it as UTF-8, or remove it"),
    ("pass --subtitle-encoding to choose", "save it as UTF-8 to be sure"),
    ("pass the right file, or --subtitles none", "upload the right file, or remove it"),
    ("pass an .srt file with --subtitles FILE", "upload an .srt file"),
    ("pass --subtitles FILE or --subtitles none", "upload a subtitle file, or untick the box"),
    ("pass another file or --subtitles none", "upload another file, or remove it"),
    (" (choose with --subtitle-lang)", ""),
)  # fmt: skip


def for_the_page(message: str) -> str:
    """A subtitle message with the command line's advice put in the page's words."""
    for cli, page in PAGE_WORDS:
        message = message.replace(cli, page)
    return message


def page_request(
    config: VideoConfig, path: str, fps: Any, max_frames: Any, upload: str | None, found: bool
) -> VideoRequest:
    """The load the page's controls ask for: fps, max frames (0: no cap) and the subtitles (an
    uploaded file, else with the box ticked what `--subtitles auto` finds: a file next to a
    server-side video or a text stream inside the video; else none), each checked as the command
    line's option is (a ConfigError line)."""
    subtitles = upload or ("auto" if found else "none")
    cap = int(max_frames or 0)  # the box's 0: no cap
    return VideoRequest(
        path, updated(config, by="page", fps=fps or 0, max_frames=cap, subtitles=subtitles)
    )


def max_new_tokens(value: Any, default: int | None) -> int | None:
    """The page's "max new tokens" box: empty means the server's default (None: the checkpoint's
    own); anything but a whole number of 1 or more is one EngineError line."""
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number.is_integer() and number >= 1):
        raise EngineError(f"max new tokens must be a whole number of 1 or more (got {value})")
    return int(number)


class ChatApp:
    """The handlers behind the page: each browser tab is a client of the engine service, asking
    about its own video in its own conversation."""

    def __init__(
        self, service: EngineService, config: Config, *, allow_paths: Sequence[str] | None
    ) -> None:
        self.service = service
        self.config = config
        self.allow_paths = [Path(p).resolve() for p in (allow_paths or [])]
        self.max_upload_mb = config.serve.max_upload_mb

    @property
    def engine(self) -> Engine:
        """The engine the page uses now (a dead group is replaced by a fresh one)."""
        return self.service.engine

    # ---- video
    # ----------------------------------------------------------------------------------------------
    def _resolve(self, upload: str | None, server_path: str | None) -> tuple[str, bool]:
        """(path to load, whether it came from the server side); raises EngineError with what to
        do."""
        server_path = (server_path or "").strip()
        if server_path:
            if not self.allow_paths:
                raise EngineError(
                    "server paths are off; upload the video, or restart with --allow-paths DIR"
                )
            try:
                path = allowed_path(server_path, self.allow_paths)
                existing_file(path, server_path, "video")  # a FIFO is named a FIFO
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            return str(path), True
        if upload and any(Path(upload).resolve().is_relative_to(root) for root in self.allow_paths):
            # a server-side video the player shows in place
            return str(Path(upload).resolve()), True
        if not upload:
            raise EngineError(
                "upload a video first"
                + (" or type a path on the server" if self.allow_paths else "")
            )
        size_mb = os.path.getsize(upload) / 2**20
        if size_mb > self.max_upload_mb:
            limit = f"{self.max_upload_mb:g} MB"
            raise EngineError(
                f"the upload is {size_mb:.0f} MB, over the {limit} limit (--max-upload-mb)"
            )
        return upload, False

    def status(self, client: Client | None = None, note: str = "", loaded: str = "") -> str:
        """The status line of a tab: a note, then its own video (never another tab's) and what
        its load said (`loaded`: its notes and each rank's figures, kept until the next load)."""
        parts = [note] if note else []
        if client is not None and client.summary is not None:
            summary = client.summary
            parts += [f"**{Path(summary.path).name}**: {describe_video(summary)}", loaded]
        else:
            parts.append("No video loaded in this browser tab yet.")
        return "\n\n".join(filter(None, parts))

    def transcript(self, owner=None, moments=None) -> str:
        """The transcript of the tab's own video, if its speech was transcribed (lines near
        `moments`, where the tab's last answer looked, marked); "" otherwise."""
        client = self.service.client(owner or uuid.uuid4().hex)
        summary = client.summary
        if summary is None:
            return ""
        return transcript_markdown(summary.transcript, SEEK_PREFIX, moments)

    def videos(self):
        """The picker's choices: the videos in the allowed folders now."""
        return gr.Dropdown(choices=allowed_videos(self.allow_paths))

    def _error(self, exc: BaseException) -> str:
        """One readable line in the page's words."""
        if isinstance(exc, NoVideo):
            return NO_VIDEO
        if isinstance(exc, GroupFailed) and self.service.can_restart():
            return f"{exc}; the workers restart on the next request"
        if isinstance(exc, ConfigError):  # a box of the page: named as the page names it
            return frontend_words(str(exc), VideoConfig, "page")[0]
        return for_the_page(_error(exc))

    def load(
        self,
        upload,
        server_path,
        fps,
        max_frames,
        subtitle_file=None,
        found_subtitles=True,
        owner=None,
        progress=gr.Progress(),
    ):
        """Decode and encode the video on every rank, with live progress; this tab's conversation
        starts afresh. Subtitles (an uploaded file, or those found with the video) go into the
        prompt after the video."""
        owner = owner or uuid.uuid4().hex
        client = self.service.client(owner)
        notes: list[str] = []
        try:
            path, from_server = self._resolve(upload, server_path)
            request = page_request(
                self.config.video, path, fps, max_frames, subtitle_file, bool(found_subtitles)
            )
            with self.service.lease(owner) as lease:
                progress(0.0, desc="starting")
                with _warnings_into(notes):
                    summary = lease.load(request, _progress_reporter(progress))
                stats = lease.stats()
                notes[:0] = lease.notes
        except Exception as exc:  # noqa: BLE001 - shown to the user, the server keeps going
            line = self._error(exc)
            for given in (upload, subtitle_file):  # an upload is named by its name, not its path
                line = _upload_named(line, given, self.allow_paths)
            error = self.status(client, f"⚠️ error: {line}")
            return error, gr.skip(), gr.skip(), owner, gr.skip(), gr.skip()
        note = f"kv mode: {stats.get('kv mode', '?')} · world size {stats.get('world size', '?')}"
        if summary.subtitle_source:
            source = summary.subtitle_source
            note = f"subtitles: {placed_line(summary, source)} · {note}"
        notes = [for_the_page(n) for n in notes]
        loaded = "\n\n".join(filter(None, [_warning_lines(notes), note, memory_table(stats)]))
        player = path if from_server else gr.skip()
        return self.status(client, loaded=loaded), [], player, owner, loaded, None

    # ---- chat
    # ----------------------------------------------------------------------------------------------
    def chat(
        self, message: str, history: list, max_new, owner, loaded="", progress=gr.Progress()
    ) -> Iterator[tuple]:
        """Stream one answer into the chat, about this tab's video, in this tab's conversation;
        the status keeps what the tab's load said (`loaded`), and the last output is where the
        answer looked (for the transcript)."""
        owner = owner or uuid.uuid4().hex
        client = self.service.client(owner)
        message = (message or "").strip()
        skip = (gr.skip(), gr.skip())  # the status and the moments, until the answer ends
        if not message:
            yield history, "", owner, *skip
            return
        history = list(history or [])
        try:
            limit = max_new_tokens(max_new, self.config.generation.max_new_tokens)
            self.engine.check_question(message)  # a pasted book never reaches a rank
        except EngineError as exc:
            history.append({"role": "user", "content": shortened(message)})
            history.append({"role": "assistant", "content": [_text(f"⚠️ error: {exc}")]})
            yield history, "", owner, *skip
            return
        fresh = not history  # a new chat (the browser cleared its own)
        duration = client.summary.duration_s if client.summary is not None else None
        history.append({"role": "user", "content": link_timestamps(message, duration)})
        # A typed text part is shown verbatim; a plain string would go through inspect.cleandoc,
        # which strips the answer's leading space and dedents code blocks.
        part = _text("")
        history.append({"role": "assistant", "content": [part]})
        yield history, "", owner, *skip
        try:
            lease = self.service.lease(owner)
        except EngineError as exc:  # the queue is full
            part["text"] = f"⚠️ error: {self._error(exc)}"
            yield history, "", owner, *skip
            return
        with lease:
            if fresh:
                lease.start_over()
            for _ in self._answer(message, limit, part, lease, progress):
                yield history, "", owner, *skip
            looked = getattr(lease.engine.last_answer, "evidence", None)  # this tab's answer
        yield history, "", owner, self.status(client, loaded=loaded), looked

    def _answer(self, message: str, limit: int, part: dict, lease: Lease, progress):
        """Fill `part` with the answer (the engine leased); yields after each piece. Errors become
        one line in it."""
        text, notes, duration = "", [], None
        try:
            notes = lease.ready(_progress_reporter(progress))
            summary = lease.client.summary
            duration = summary.duration_s
            warned: list[str] = []
            pieces = lease.ask(message, max_new_tokens=limit)
            # on Gradio's cancel (GeneratorExit) closing stops the group and drains the turn
            with _warnings_into(warned), contextlib.closing(pieces):
                for piece in pieces:
                    text += printable(piece)
                    part["text"] = link_timestamps(text, duration)
                    yield
            about = f"about {Path(summary.path).name}"
            footer = f"*{' · '.join([about, *notes, answer_footer(lease.engine)])}*"
            seen = answer_evidence(lease.engine, summary.path)
            footer = f"{seen}  \n{footer}" if seen else footer  # the footer's paragraph
            part["text"] = "\n\n".join(
                filter(None, [link_timestamps(text, duration), footer, _warning_lines(warned)])
            )
        except Exception as exc:  # noqa: BLE001 - shown in the chat, the server keeps going
            # a group that died mid-answer keeps the partial answer
            line = f"⚠️ error: {self._error(exc)}"
            part["text"] = "\n\n".join(
                filter(None, [link_timestamps(text, duration), *notes, line])
            )

    def request_stop(self, owner=None) -> None:
        """This tab's Stop: only its own answer stops (it does not wait in the engine's queue)."""
        self.service.stop(owner)

    def reset(self, owner, loaded=""):
        owner = owner or uuid.uuid4().hex
        client = self.service.client(owner)
        try:
            with self.service.lease(owner) as lease:
                lease.start_over()  # the next question starts from the video prompt
        except EngineError as exc:  # the queue is full
            line = f"⚠️ error: {self._error(exc)}"
            return gr.skip(), self.status(client, line, loaded), owner, gr.skip()
        note = "Conversation cleared; your video stays loaded." if client.request else ""
        return [], self.status(client, note, loaded), owner, None

    def stats(self, owner=None) -> str:
        try:
            with self.service.lease(owner or "") as lease:
                stats = lease.stats()  # another tab's video and answers left out
                note = "\n".join(lease.notes)
        except Exception as exc:  # noqa: BLE001
            return f"⚠️ error: {self._error(exc)}"
        lines = [f"- {k}: {v}" for k, v in stats.items() if k != "ranks"]
        return "\n".join(filter(None, [note, *lines])) + "\n\n" + memory_table(stats)


def _upload_named(line: str, upload: str | None, allow_paths: list) -> str:
    """`line` with an uploaded file's path on the server (gradio's temporary folder, nothing the
    user chose or should see) said as the file's name."""
    if not isinstance(upload, str) or not upload:
        return line
    if any(Path(upload).resolve().is_relative_to(r) for r in allow_paths):
        return line
    for path in {str(upload), str(Path(upload).resolve())}:
        line = line.replace(path, Path(upload).name)
    return line


@contextlib.contextmanager
def _warnings_into(notes: list[str]) -> Iterator[None]:
    """Add the messages of lvx's warnings raised meanwhile (an fps clamped to the video's own, a
    prompt beyond the trained length) to `notes` when the block ends, so the page shows them instead
    of only the server's stderr.

    One recording per request (not per streamed token). Recording is process-wide, so warnings from
    other threads (Gradio, pandas) are caught too: those are passed on to the usual display, not
    shown on the page.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if is_lvx_source(w.filename):
            if str(w.message) not in notes:
                notes.append(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _warning_lines(notes: list[str]) -> str:
    return "\n\n".join(f"⚠️ {note}" for note in notes)


def _progress_reporter(progress: gr.Progress):
    """An engine progress callback that drives `progress` from whatever thread the engine calls it
    on."""
    context = contextvars.copy_context()  # Gradio finds the event through context variables
    guard = threading.Lock()
    started: dict[str, tuple[float, int]] = {}

    def report(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        t0, d0 = started.setdefault(stage, (now, done))
        rate = (done - d0) / (now - t0) if now > t0 and done > d0 else 0.0
        eta = f", about {(total - done) / rate:.0f} s left" if rate > 0 and total else ""
        if not total:
            desc = f"{stage}: opening the video"
        else:
            desc = f"{stage}: {done}/{total}" + (f" at {rate:.1f} fr/s{eta}" if rate else "")
        with guard:
            context.run(progress, (done, total or None), desc=desc, unit="frames")

    return report


# The page's own layout rules: each rank's figures on one line a cell (the table scrolls sideways in
# a narrow column instead of breaking words), the transcript under the player in a box of its own
# height (it scrolls; the chat stays in view beside or below it).
PAGE_CSS = """
#lvx-status table, #lvx-stats table { display: block; overflow-x: auto; max-width: 100%; }
#lvx-status th, #lvx-status td, #lvx-stats th, #lvx-stats td {
  white-space: nowrap !important; word-break: normal !important; overflow-wrap: normal !important;
}
#lvx-transcript { max-height: 14em; overflow-y: auto; }
"""


def path_example(allow_paths: Sequence[Path]) -> str:
    """The path box's placeholder: one example path, in the first allowed folder."""
    return f"e.g. {allow_paths[0] / 'movie.mp4'}" if allow_paths else ""


def _video_column(ui: ChatApp, default_fps: float, default_max_frames: int | None) -> tuple:
    """The left column: the player with the transcript under it, where the video comes from (an
    upload, a video picked in the allowed folders, or a path typed), fps and frame cap, Load and
    the status line."""
    with gr.Column(scale=2):
        video = gr.Video(label="Video", sources=["upload"], format=None, elem_id="lvx-video")
        transcript = gr.Markdown("", elem_id="lvx-transcript")
        picker = gr.Dropdown(
            allowed_videos(ui.allow_paths),
            value=None,
            label="…or a video in the allowed folders",
            visible=bool(ui.allow_paths),
            elem_id="lvx-pick",
        )
        server_path = gr.Textbox(
            label="…or a path on the server",
            visible=bool(ui.allow_paths),
            elem_id="lvx-path",
            placeholder=path_example(ui.allow_paths),
        )
        with gr.Row():
            fps = gr.Number(default_fps, label="fps", elem_id="lvx-fps")
            max_frames = gr.Number(
                default_max_frames or 0,
                label="max frames (0 = no cap)",
                precision=0,
                elem_id="lvx-max-frames",
            )
        with gr.Row():
            subtitle_file = gr.File(
                label="Subtitles (.srt, .vtt, .ass)",
                file_types=list(SIDECAR_EXTENSIONS),
                type="filepath",
                elem_id="lvx-subtitles",
            )
            found = gr.Checkbox(
                True,
                label="Use subtitles inside the video (or next to it on the server)",
                elem_id="lvx-found-subtitles",
            )
        load_btn = gr.Button("Load", variant="primary", elem_id="lvx-load")
        status = gr.Markdown(ui.status(), elem_id="lvx-status")
    sources = (video, transcript, picker, server_path, fps, max_frames, subtitle_file, found)
    return (*sources, load_btn, status)


def _chat_column(ui: ChatApp) -> tuple:
    """The right column: the chat, the question box, the buttons and the generation settings."""
    with gr.Column(scale=3):
        chatbot = PageChatbot(
            label="Chat", height=480, elem_id="lvx-chat", feedback_options=None, buttons=["copy"]
        )
        message = gr.Textbox(
            label="Question", placeholder="Ask about the video, then Enter", elem_id="lvx-question"
        )
        with gr.Row():
            buttons = (
                gr.Button("Send", variant="primary", elem_id="lvx-send"),
                gr.Button("Stop", elem_id="lvx-stop"),
                gr.Button("Reset", elem_id="lvx-reset"),
                gr.Button("Stats", elem_id="lvx-stats-btn"),
            )
        with gr.Accordion("Generation", open=False):
            limit = ui.config.generation.max_new_tokens or ui.engine.describe()["max new tokens"]
            max_new = gr.Number(limit, label="max new tokens", precision=0)
        stats_box = gr.Markdown("", elem_id="lvx-stats")
    return chatbot, message, buttons, max_new, stats_box


def build_app(
    service: EngineService,
    config: Config,
    *,
    allow_paths: Sequence[str] | None = None,
    title: str = "lvx: chat with a long video",
) -> gr.Blocks:
    """The page on the engine `service` shares: video and load controls on the left, the chat on
    the right. Launch options ride along in `demo.lvx_launch` (upload limit, folders the player may
    read)."""
    if allow_paths:
        # the player reads those videos in place instead of copying them
        gr.set_static_paths(list(allow_paths))
    ui = ChatApp(service, config, allow_paths=allow_paths)
    video_defaults = (config.video.fps, config.video.max_frames)
    with gr.Blocks(title="lvx") as demo:
        # the tab's client id, what its load said (kept in the status after its answers), and where
        # its last answer looked (marked in the transcript): none is a field of the API
        owner, loaded, moments = gr.State(None), gr.State(""), gr.State(None)
        gr.Markdown(f"## {title}")
        with gr.Row():
            left = _video_column(ui, *video_defaults)
            chatbot, message, buttons, max_new, stats_box = _chat_column(ui)
        video, transcript, picker, server_path, fps, max_frames, subtitle_file, found = left[:8]
        load_btn, status = left[8:]
        send_btn, stop_btn, reset_btn, stats_btn = buttons
        engine_event = dict(concurrency_id=GPU, concurrency_limit=1)
        show_transcript = dict(fn=ui.transcript, inputs=[owner, moments], outputs=[transcript])
        load_inputs = [video, server_path, fps, max_frames, subtitle_file, found, owner]
        load_outputs = [status, chatbot, video, owner, loaded, moments]
        load_btn.click(ui.load, load_inputs, load_outputs, api_name="load", **engine_event).then(
            api_name=False, **show_transcript
        )
        chat_io = dict(
            fn=ui.chat,
            inputs=[message, chatbot, max_new, owner, loaded],
            outputs=[chatbot, message, owner, status, moments],
            show_progress="minimal",
            **engine_event,
        )
        message.submit(api_name="chat", **chat_io).then(api_name=False, **show_transcript)
        send_btn.click(api_name=False, **chat_io).then(api_name=False, **show_transcript)
        stop = dict(api_name="stop", queue=False, concurrency_limit=None)
        stop_btn.click(ui.request_stop, [owner], None, **stop)
        reset_io = ([owner, loaded], [chatbot, status, owner, moments])
        for clear, name in ((reset_btn.click, "reset"), (chatbot.clear, False)):  # or the bin icon
            clear(ui.reset, *reset_io, api_name=name, **engine_event).then(
                api_name=False, **show_transcript
            )
        stats_btn.click(ui.stats, [owner], [stats_box], api_name="stats", **engine_event)
        picker.change(lambda chosen: chosen or gr.skip(), [picker], [server_path], api_name=False)
        demo.load(None, js=SEEK_JS)
        if ui.allow_paths:  # the videos there when the page opens
            demo.load(ui.videos, None, [picker], api_name=False)
    demo.lvx_launch = {  # type: ignore[attr-defined]
        "max_file_size": int(config.serve.max_upload_mb * 2**20),  # bytes
        "allowed_paths": [str(p) for p in ui.allow_paths],
        "css": THUMB_CSS + PAGE_CSS,
    }
    return demo
