"""A Chat Completions request of the OpenAI-compatible API, read and checked.

The body's `messages` become the turns `Engine.chat` takes (the video as `<|video|>` in the first
user message, what comes before it as the video's `VideoOpening`); `video_url` parts point to a file
under --allow-paths (`file:///abs/path`, the page's rule and messages) or carry the video
(`data:video/mp4;base64,...`, saved once under the server's upload folder, named by its content);
the video fields the config lets the API set (`settable(VideoConfig, "api")`) become the video's
options, checked once, as the command line's are, when the request is built; the generation fields
become the engine's overrides. Every problem is an `ApiError`: the HTTP status and the one line the
client sees, in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from lvx_app.config import VideoConfig, settable
from lvx_app.engine.api import VideoOpening
from lvx_app.engine.describe import shortened

VIDEO = "<|video|>"  # where the video goes in a turn (lvx_app.engine.chat_prompt)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
KEEP_UPLOADS = 4  # videos sent as data: URLs kept on disk (the oldest is removed first)


class ApiError(Exception):
    """A request the API refuses: `status` and one line that says what to do."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status)
        kind = kind or ("server_error" if self.status >= 500 else "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


@dataclass(frozen=True)
class VideoAsk:
    """The video a request asks about, as sent: made a `VideoRequest` once its file is found."""

    url: str
    opening: VideoOpening
    options: dict[str, Any] = field(default_factory=dict)  # the video fields it sets, unchecked


@dataclass
class ChatRequest:
    turns: list[dict[str, str]]
    video: VideoAsk | None
    generation: dict[str, Any]  # Engine.chat overrides: max_new_tokens, temperature, ...
    stop: list[str]
    stream: bool
    include_usage: bool
    evidence: bool = False  # `"lvx_evidence": true`: the moments the answer looked at, returned


def read_request(body: Any) -> ChatRequest:
    """The request `body` (parsed JSON) describes; raises ApiError(400) naming the bad field."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    turns, video = read_messages(body.get("messages"))
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return ChatRequest(
        turns=turns,
        video=VideoAsk(video[0], video[1], read_video_options(body)) if video else None,
        generation=read_generation(body),
        stop=read_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and _flag(options, "include_usage"),
        evidence=_flag(body, "lvx_evidence"),
    )


def read_messages(messages: Any) -> tuple[list[dict[str, str]], tuple[str, VideoOpening] | None]:
    """(turns with the video as `<|video|>`, (the video's url, what comes before it) or None)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    turns, video = [], None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(
                f"messages[{i}] needs a role: system, user or assistant (tools are not supported)",
                f"messages[{i}].role",
            )
        role = ROLES[message["role"]]
        text, url = _content(message.get("content"), role, i)
        if url is not None:
            if video is not None:
                raise bad("one video per conversation: send a single video_url part", "messages")
            video = (url, _opening(turns, text, i))
        turns.append({"role": role, "content": text})
    if turns[-1]["role"] != "user":
        raise bad("the last message must be the user's", "messages")
    return turns, video


def _opening(before: list[dict[str, str]], text: str, index: int) -> VideoOpening:
    """What comes before the video: at most one system message, and the text before it in the
    first user message."""
    if any(t["role"] != "system" for t in before) or len(before) > 1:
        raise bad(
            "the video goes in the first user message (after at most one system message)",
            f"messages[{index}]",
        )
    system = before[0]["content"] if before else ""
    return VideoOpening(system=system, before=text.partition(VIDEO)[0])


def _content(content: Any, role: str, index: int) -> tuple[str, str | None]:
    """(the text of a message, the video part's url put as `<|video|>`; None without one)."""
    where = f"messages[{index}].content"
    if content is None and role == "assistant":
        return "", None
    if isinstance(content, str):
        if VIDEO in content or "<|image|>" in content:
            raise bad("send the video as a video_url part, not as a marker in the text", where)
        return content, None
    if not isinstance(content, list) or not content:
        raise bad("content must be a string or a non-empty list of parts", where)
    before, after, url = [], [], None
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text, _ = _content(part["text"], role, index)
            (before if url is None else after).append(text)
        elif kind == "video_url" and role == "user" and url is None:
            url = _url(part.get("video_url"), where)
        elif kind == "video_url":
            raise bad("one video_url part, in a user message", where)
        else:
            raise bad(
                f"unsupported content part {kind!r}: use text and video_url parts "
                "(images are not supported)",
                where,
            )
    if url is None:
        return "\n".join(before), None
    lead = "\n".join(before) + "\n" if before else ""
    return lead + VIDEO + "\n".join(after), url


def _url(video_url: Any, where: str) -> str:
    url = video_url.get("url") if isinstance(video_url, dict) else video_url
    if not isinstance(url, str) or not url:
        raise bad(
            'a video_url part needs {"url": "file:///... or data:video/...;base64,..."}', where
        )
    return url


def read_video_options(body: dict) -> dict[str, Any]:
    """The fields beyond OpenAI's that say how to load the video (`extra_body` of the `openai`
    client): the video options the API may set, fps, max_frames (0: no cap) and subtitles (auto,
    none or a file under --allow-paths); null or absent: the server's own."""
    return {name: body[name] for name in settable(VideoConfig, "api") if body.get(name) is not None}


def read_generation(body: dict) -> dict[str, Any]:
    """The engine's generation overrides from max_tokens / max_completion_tokens, temperature,
    top_p, seed; n must be 1."""
    if body.get("n") not in (None, 1):
        raise bad("n must be 1: one answer per request", "n")
    if body.get("logprobs") or body.get("tools"):
        raise bad(
            "logprobs and tools are not supported", "logprobs" if body.get("logprobs") else "tools"
        )
    out: dict[str, Any] = {}
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None and "max_new_tokens" not in out:
            if not _is_int(body[name]) or body[name] < 1:
                raise bad(f"{name} must be a whole number of 1 or more", name)
            out["max_new_tokens"] = body[name]
    if body.get("temperature") is not None:
        out["temperature"] = _number(body, "temperature", above=None)
    if body.get("top_p") is not None:
        out["top_p"] = _number(body, "top_p", above=0, most=1)
    if body.get("seed") is not None:
        if not _is_int(body["seed"]):
            raise bad("seed must be a whole number", "seed")
        out["seed"] = body["seed"]
    return out


def read_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a string or a list of non-empty strings", "stop")
    return stops


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{name} must be true or false", name)
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, above: float | None, most: float | None = None) -> float:
    """A finite number above `above` (None: 0 or more) and at most `most`."""
    value = body[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > above if above is not None else value >= 0)
    ok = ok and (most is None or value <= most)
    if not ok:
        low = f"above {above:g}" if above is not None else "0 or more"
        raise bad(f"{name} must be a number {low}" + (f", at most {most:g}" if most else ""), name)
    return float(value)


def allowed_path(text: str, roots: list[Path]) -> Path:
    """The path `text` names, resolved, when it lies under one of `roots` (--allow-paths): the rule
    of the page and the API for files opened by path. A ValueError says, in one line, why not."""
    try:
        path = Path(text).expanduser().resolve()
    except (ValueError, OSError):  # a NUL byte, a loop of links
        raise ValueError(f"{shortened(text)!r} is not a path") from None
    if not any(path.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(p) for p in roots)
        raise ValueError(f"{text} is outside the allowed folders ({allowed})")
    return path


class VideoFiles:
    """Where a request's video (and subtitle file) is on this machine: a file under --allow-paths,
    or a data: URL saved under `folder` (named by its content, so the same video sent again is the
    same file, and its features and prompt are found in the caches)."""

    def __init__(self, allow_paths: list[str], max_upload_mb: float, folder: Path) -> None:
        self.roots = [Path(p).resolve() for p in allow_paths]
        self.max_upload_mb, self.folder = max_upload_mb, folder

    def video(self, url: str) -> str:
        if url.startswith("data:"):
            return self._save(url)
        if not url.startswith("file://"):
            raise bad(
                "a video_url must be file:///path/on/the/server (under --allow-paths) or a "
                "data:video/...;base64,... URL",
                "video_url",
            )
        return self.server_file(unquote(urlparse(url).path), "video_url")

    def subtitles(self, choice: str) -> str:
        """auto, none, or a subtitle file under --allow-paths."""
        if choice.strip().lower() in ("auto", "none"):
            return choice.strip().lower()
        return self.server_file(choice, "subtitles")

    def server_file(self, path_text: str, param: str) -> str:
        """The page's rule: only files under --allow-paths may be opened by path."""
        if not self.roots:
            raise bad(
                "server paths are off; send the video as a data: URL, or restart with "
                "--allow-paths DIR",
                param,
            )
        try:
            path = allowed_path(path_text, self.roots)
        except ValueError as exc:
            raise bad(str(exc), param) from None
        if not path.is_file():
            raise bad(
                f"{'video' if param == 'video_url' else 'file'} not found: {path_text}", param
            )
        return str(path)

    def _save(self, url: str) -> str:
        head, _, data = url.partition(",")
        if not head.startswith("data:video/") or not head.endswith(";base64"):
            raise bad("a data URL must be data:video/<type>;base64,<the video>", "video_url")
        limit = self.max_upload_mb * 2**20
        if len(data) * 3 / 4 > limit:
            self.too_large(len(data) * 3 / 4)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad("the video's data URL is not valid base64", "video_url") from None
        suffix = "." + head.removeprefix("data:video/").split(";")[0].removeprefix("x-")
        path = self.folder / (hashlib.sha256(raw).hexdigest()[:32] + suffix.lower())
        if path.exists():
            path.touch()  # the most recently asked about is kept longest
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            part.write_bytes(raw)
            os.replace(part, path)
            self._forget_old()
        return str(path)

    def too_large(self, size_bytes: float) -> None:
        limit = f"{self.max_upload_mb:g} MB"
        raise ApiError(
            413,
            f"the video is {size_bytes / 2**20:.1f} MB, over the {limit} limit (--max-upload-mb)",
            "request_too_large",
            "video_url",
        )

    def _forget_old(self) -> None:
        saved = sorted(self.folder.glob("*.*"), key=lambda p: p.stat().st_mtime)
        for old in saved[:-KEEP_UPLOADS]:
            old.unlink(missing_ok=True)
