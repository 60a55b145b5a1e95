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
import contextlib
import hashlib
import os
import re
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from lvx_app.config import (
    ConfigError,
    GenerationConfig,
    VideoConfig,
    frontend_words,
    settable,
    updated,
)
from lvx_app.engine.describe import shortened
from lvx_app.engine.records import VideoOpening
from lvx_app.regular_files import read_regular, what_it_is
from lvx_ui.api_errors import ApiError, bad
from lvx_ui.frames import (
    IMAGE_TYPES,
    FrameError,
    check_rate,
    decoded_frames,
    frame_sizes,
    frames_cost,
    frames_name,
    video_size,
    write_frames,
)
from lvx_ui.request_memory import Reservation

VIDEO = "<|video|>"  # where the video goes in a turn (lvx_app.engine.chat_prompt)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
KEEP_UPLOADS = 4  # videos sent as data: URLs kept on disk, beyond those requests still use
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # each stop string is looked for after every piece
FRAME_KEYS = {"num_frames": "num_frames", "fps": "fps"}  # vLLM's names: the video options
EVERY_FRAME = 2**31 - 1  # vLLM's num_frames -1: more frames than any video has, so all of them
FRAME_VIDEOS = ("data:video/jpeg;base64", "data:video/png;base64")  # vLLM's frames as a video
BASE64_PIECE = 2**22  # characters of base64 decoded at a time (a multiple of 4)
VIDEO_TYPE = re.compile(r"data:video/([a-z0-9][a-z0-9.+-]{0,31});base64")  # mp4, x-matroska, ...


@dataclass(frozen=True)
class VideoAsk:
    """The video a request asks about, as sent: made a `VideoRequest` once its file is found."""

    url: str | tuple[str, ...]  # a video, or its frames (image URLs, in order)
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
    user: str = ""  # OpenAI's end-user id: with the key, whose conversation this is
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
        user=_user(body),
        evidence=_flag(body, "lvx_evidence"),
    )


def _user(body: dict) -> str:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user must be a string", "user")
    return valid_text(user or "", "user")


Media = str | tuple[str, ...]  # a video's URL, or its frames' image URLs


def read_messages(messages: Any) -> tuple[list[dict[str, str]], tuple[Media, VideoOpening] | None]:
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
                raise bad(
                    "one video per conversation: send a single video_url part, or its frames as "
                    "image_url parts in one message",
                    "messages",
                )
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


def _content(content: Any, role: str, index: int) -> tuple[str, Media | None]:
    """(the text of a message with its video as `<|video|>` where the first video or frame part
    stood, the video's URL or its frames' URLs; None without one)."""
    where = f"messages[{index}].content"
    if content is None and role == "assistant":
        return "", None
    if isinstance(content, str):
        valid_text(content, where)
        if VIDEO in content or "<|image|>" in content:
            raise bad("send the video as a video_url part, not as a marker in the text", where)
        return content, None
    if not isinstance(content, list) or not content:
        raise bad("content must be a string or a non-empty list of parts", where)
    before, after, url, frames = [], [], None, []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text, _ = _content(part["text"], role, index)
            (before if url is None and not frames else after).append(text)
        elif kind in ("video_url", "video", "image_url") and role != "user":
            raise bad(f"a {kind} part belongs in a user message", where)
        elif kind in ("video_url", "video") and url is None and not frames:
            url = _video_part(part, kind, where)
        elif kind == "image_url" and url is None:
            frames.append(_url(part.get("image_url"), where, "image_url"))
        elif kind in ("video_url", "video", "image_url"):
            raise bad("one video per message: a video_url part, or its frames as image_url", where)
        else:
            raise bad(f"unsupported content part {kind!r}: use text, video_url, image_url", where)
    if len(frames) == 1:
        raise bad(
            "one image is a still picture, which lvx does not take: send the video, or two or "
            "more of its frames as image_url parts",
            where,
        )
    media = url if url is not None else (tuple(frames) or None)
    if media is None:
        return "\n".join(before), None
    lead = "\n".join(before) + "\n" if before else ""
    return lead + VIDEO + "\n".join(after), media


def _video_part(part: dict, kind: str, where: str) -> Media:
    """A video_url part's URL; a Qwen-style video part's URL or list of frame URLs."""
    if kind == "video_url":
        return _url(part.get("video_url"), where)
    video = part.get("video")
    if isinstance(video, list) and len(video) > 1 and all(isinstance(v, str) for v in video):
        return tuple(valid_text(v, where) for v in video)
    return _url(video, where)


def _url(video_url: Any, where: str, kind: str = "video_url") -> str:
    url = video_url.get("url") if isinstance(video_url, dict) else video_url
    if not isinstance(url, str) or not url:
        media = "video" if kind == "video_url" else "image"
        article = "a" if kind == "video_url" else "an"
        raise bad(
            f'{article} {kind} part needs {{"url": "file:///... or data:{media}/...;base64,..."}}',
            where,
        )
    return valid_text(url, where)


def sent_as_frames(url: Media) -> bool:
    """Whether a video comes as its frames (image URLs, or vLLM's data:video/jpeg form)."""
    return not isinstance(url, str) or url_head(url).lower() in FRAME_VIDEOS


def url_head(url: str) -> str:
    """What comes before a data: URL's first comma (the whole URL without one), the rest never
    copied."""
    end = url.find(",")
    return url if end < 0 else url[:end]


def base64_pieces(text: str, start: int) -> Iterator[bytes]:
    """The bytes the base64 `text[start:]` spells, a piece at a time, so neither the text (a
    video's data URL: most of a request's memory) nor what it spells is ever held whole;
    ValueError when it is no strict base64 (padding only at its end)."""
    for at in range(start, len(text), BASE64_PIECE):
        piece = text[at : at + BASE64_PIECE]
        if "=" in piece and at + BASE64_PIECE < len(text):
            raise ValueError("padding before the end")
        yield base64.b64decode(piece, validate=True)


def valid_text(text: str, where: str) -> str:
    """`text`, when it is Unicode the tokenizer can take: JSON's escapes can spell a lone
    surrogate (`\\ud800`), which is no character at all."""
    if text.isascii():  # a data: URL's base64 is never copied to be checked
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(
            f"the text holds {text[exc.start]!r} at character {exc.start}, which is not valid "
            "Unicode (a lone surrogate): send UTF-8 text",
            where,
        ) from None
    return text


def read_video_options(body: dict) -> dict[str, Any]:
    """The fields beyond OpenAI's that say how to load the video (`extra_body` of the `openai`
    client): the video options the API may set, fps, max_frames (0: no cap) and subtitles (auto,
    speech, none or a file under --allow-paths); null or absent: the server's own."""
    options = {n: body[n] for n in settable(VideoConfig, "api") if body.get(n) is not None}
    for name, value in options.items():
        if isinstance(value, str):
            valid_text(value, name)
    if "num_frames" in options:  # as inside media_io_kwargs: a count, or -1 for every frame
        options["num_frames"] = _num_frames(options["num_frames"], "num_frames")
    for name, value in frame_options(body).items():
        if options.setdefault(name, value) != value:
            raise bad(f"{name} is given twice with different values", name)
    return options


def frame_options(body: dict) -> dict[str, Any]:
    """vLLM's per-request frame options, `media_io_kwargs: {"video": {"num_frames", "fps"}}` and
    `mm_processor_kwargs: {"num_frames", "fps"}`, as the video options they mean: num_frames is
    num_frames (exactly that many frames over the whole video, as vLLM samples them; -1,
    as in vLLM, every frame), fps is fps. Any other key is refused: a result must be what
    its settings say."""
    out: dict[str, Any] = {}
    for name in ("media_io_kwargs", "mm_processor_kwargs"):
        given = body.get(name)
        if given is None:
            continue
        if name == "media_io_kwargs":
            if not isinstance(given, dict) or set(given) - {"video"}:
                raise bad(f'{name} takes {{"video": {{"num_frames": N, "fps": F}}}}', name)
            given = given.get("video") or {}
        if not isinstance(given, dict):
            raise bad(f"{name} must be an object", name)
        for key, value in given.items():
            if key not in FRAME_KEYS:
                raise bad(f"{name}: lvx takes num_frames and fps, not {shortened(key)!r}", name)
            if key == "num_frames":
                value = _num_frames(value, name)
            if out.setdefault(FRAME_KEYS[key], value) != value:
                raise bad(f"{key} is given twice with different values", name)
    return out


def _num_frames(value: Any, name: str) -> int:
    """vLLM's num_frames: exactly N frames spread over the video, or -1 for every frame (a count
    no video reaches: `spread_indices` then keeps them all); anything else is refused in
    num_frames' own words."""
    if type(value) is not int or not (value == -1 or value >= 1):
        where = "" if name == "num_frames" else f"{name}: "
        raise bad(
            f"{where}num_frames takes a whole number of 1 or more, or -1 for all the frames "
            f"(not {shortened(repr(value))})",
            name,
        )
    return EVERY_FRAME if value == -1 else value


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
    sampling = {k: body[k] for k in settable(GenerationConfig, "api") if body.get(k) is not None}
    try:  # the config's own checks, worded by the API's field names
        updated(GenerationConfig(), by="api", **sampling)
    except ConfigError as exc:
        raise bad(*frontend_words(str(exc), GenerationConfig, "api")) from None
    return {**out, **sampling}


def read_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(
            f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each",
            "stop",
        )
    return [valid_text(s, "stop") for s in stops]


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{name} must be true or false", name)
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def allowed_path(text: str, roots: list[Path]) -> Path:
    """The path `text` names when it lies under one of `roots` (--allow-paths, resolved), the rule
    of the page and the API for files opened by path, judged as resolved and as given: a path that
    passes through an allowed folder is allowed, wherever a link in it leads (a Hugging Face
    cache's files are links into its blobs), and `..` counts only resolved. Returns the path
    through the allowed folder; a ValueError says, in one line, why not."""
    try:
        given = Path(text).expanduser().absolute()
        path = given.resolve()
        through = _through_a_root(given, roots)
    except (ValueError, OSError):  # a NUL byte, a loop of links
        raise ValueError(f"{shortened(text)!r} is not a path") from None
    if any(path.is_relative_to(root) for root in roots):
        return path
    if through is not None:
        return through
    allowed = ", ".join(str(p) for p in roots)
    resolved = f" (resolved: {path})" if path != given else ""
    raise ValueError(f"{text}{resolved} is outside the allowed folders ({allowed})")


def _through_a_root(given: Path, roots: list[Path]) -> Path | None:
    """`given` with its first leading part that resolves into an allowed folder resolved, when one
    does; never for a path with `..` (read as text, a link's `..` would lead elsewhere). Each
    leading part is resolved from the one before (one `lstat`, a link read where there is one),
    and below a part that does not exist nothing does, so the rest is read as text: a long path
    costs time in proportion to its length."""
    if ".." in given.parts:
        return None
    tops = [str(root).rstrip("/") + "/" for root in roots]

    def under(path: str) -> bool:
        return any((path + "/").startswith(top) for top in tops)

    parts = given.parts
    head = os.path.realpath(parts[0])
    for k in range(1, len(parts) + 1):
        if k > 1:
            path = os.path.join(head, parts[k - 1])
            try:
                link = stat.S_ISLNK(os.lstat(path).st_mode)
            except OSError:  # missing, not a folder, too long: the rest is text
                rest = Path(path, *parts[k:])
                return rest if under(str(rest)) else None
            head = os.path.realpath(path) if link else path
        if under(head):
            return Path(head, *parts[k:])
    return None


def existing_file(path: Path, given: str, what: str) -> None:
    """Refuse, in one ValueError line in the words of `what` ("video", "file"), a `path` that is
    no regular file: missing, a folder or a FIFO named as what it is, a name too long to open."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {shortened(given)}") from None
    except (OSError, ValueError) as exc:  # a name too long, a loop of links, no permission
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "cannot be read"
        raise ValueError(f"{shortened(given)!r} cannot be opened: {reason.lower()}") from None
    if not stat.S_ISREG(mode):
        noun = what if what == "file" else f"{what} file"
        raise ValueError(f"{shortened(given)} is {what_it_is(mode)}, not a {noun}")


LOCAL_HOSTS = ("", "localhost")  # file:///path and file://localhost/path name this machine's files


def local_path(url: str, param: str) -> str:
    """The path a file:// URL names on this machine; a URL naming another host is refused (its
    path would otherwise be opened here, as if the host were not there)."""
    try:
        parsed = urlparse(url)
    except ValueError:  # `file://[x/y`: an IPv6 host left open
        raise bad(
            f"{shortened(url)!r} is not a URL: send file:///path/on/the/server", param
        ) from None
    if parsed.netloc.lower() not in LOCAL_HOSTS:
        raise bad(
            f"a file:// URL names a file on this server: file:///path, not a host "
            f"({shortened(parsed.netloc)!r})",
            param,
        )
    return unquote(parsed.path)


SAVED_MTIME_NS = 10**18  # every upload's mtime: a file named by its content keeps one identity


def used(path: Path) -> None:
    """Mark an upload as just used (its access time, which orders what is kept), its modification
    time the one all uploads share: the same frames or video sent again, even after its file was
    removed and made anew, has the same file identity, so its features come from the cache."""
    os.utime(path, ns=(time.time_ns(), SAVED_MTIME_NS))


class VideoFiles:
    """Where a request's video (and subtitle file) is on this machine: a file under --allow-paths,
    or a data: URL saved under `folder` (named by its content, so the same video sent again is the
    same file, and its features and prompt are found in the caches)."""

    def __init__(self, allow_paths: list[str], max_upload_mb: float, folder: Path) -> None:
        self.roots = [Path(p).resolve() for p in allow_paths]
        self.max_upload_mb, self.folder = max_upload_mb, folder
        self._held: Counter[Path] = Counter()  # uploads the requests in flight (or waiting) use
        self._lock = threading.Lock()

    def video(self, url: Media, fps: float = 1.0, held: Reservation | None = None) -> str:
        """The file of the video `url` names, or of the frames it carries (image URLs, or vLLM's
        data:video/jpeg;base64,<f1>,<f2>,...) shown at `fps`; `release` it when done. The memory
        decoding frames takes is reserved in `held` (the request's share) before it is taken."""
        held = held or Reservation(None)
        if not isinstance(url, str):
            return self._frames([self._image(u, held) for u in url], fps, held)
        if sent_as_frames(url):
            frames = [self._b64(f, "video_url") for f in url.split(",")[1:]]
            return self._frames(frames, fps, held)
        if url.startswith("data:"):
            return self._save(url)
        if not url.startswith("file://"):
            raise bad(
                "a video_url must be file:///path/on/the/server (under --allow-paths) or a "
                "data:video/...;base64,... URL",
                "video_url",
            )
        return self.server_file(local_path(url, "video_url"), "video_url")

    def _image(self, url: str, held: Reservation) -> bytes:
        """One frame's bytes: a data:image/... URL, or a file under --allow-paths (its size
        reserved in `held` before it is read)."""
        head, _, data = url.partition(",")
        if url.startswith("file://"):
            name = self.server_file(local_path(url, "image_url"), "image_url")
            held.grow(os.stat(name).st_size, "the image files")
            try:  # a regular file only (a FIFO would block), no larger than an upload
                return read_regular(name, int(self.max_upload_mb * 2**20))
            except (OSError, ValueError) as exc:
                raise bad(f"{exc}; send an image file", "image_url") from None
        kind = re.fullmatch(r"data:image/([a-z]+);base64", head.lower())
        if kind is None or kind.group(1) not in IMAGE_TYPES:
            raise bad(
                "an image_url must be data:image/png;base64,... (or jpeg) or file:///... under "
                "--allow-paths",
                "image_url",
            )
        return self._b64(data, "image_url")

    def _b64(self, data: str, param: str) -> bytes:
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad("a frame's data URL is not valid base64", param) from None

    def _frames(self, frames: list[bytes], fps: float, held: Reservation) -> str:
        """The video file these frames make at `fps` (made once; held until `release`); the
        memory decoding them takes is reserved in `held` from their headers, before any is
        decoded."""
        size = sum(len(f) for f in frames)
        if size > self.max_upload_mb * 2**20:
            self.too_large(size)
        try:
            check_rate(fps)
        except FrameError as exc:
            raise bad(str(exc), "fps") from None
        path = self.folder / frames_name(frames, fps)
        with self._lock:
            self._held[path] += 1
            if path.exists():
                used(path)
                return str(path)
        try:
            sizes = frame_sizes(frames)
            held.grow(
                frames_cost(sizes),
                f"decoding {len(frames)} frames of {sizes[0][0]}x"
                f"{sizes[0][1]} (each resized to the first)",
            )
            self.folder.mkdir(parents=True, exist_ok=True)
            shape = video_size(sizes[0])
            write_frames(path, decoded_frames(frames, shape), fps, shape)
            used(path)
        except FrameError as exc:
            self.release(str(path))
            raise bad(str(exc), "image_url") from None
        except BaseException:
            self.release(str(path))
            raise
        self._forget_old()
        return str(path)

    def subtitles(self, choice: str) -> str:
        """auto, speech, none, or a subtitle file under --allow-paths."""
        if choice.strip().lower() in ("auto", "speech", "none"):
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
            existing_file(path, path_text, "video" if param == "video_url" else "file")
        except ValueError as exc:
            raise bad(str(exc), param) from None
        return str(path)

    def _save(self, url: str) -> str:
        """Save the video a data: URL carries; it stays on disk while a request holds it
        (`release`)."""
        head = url_head(url)
        kind = VIDEO_TYPE.fullmatch(head.lower())
        if kind is None:
            raise bad(
                "a data URL must be data:video/<type>;base64,<the video>, the type a short name "
                "such as mp4 or webm",
                "video_url",
            )
        limit = self.max_upload_mb * 2**20
        start = len(head) + 1
        if (len(url) - start) * 3 / 4 > limit:
            self.too_large((len(url) - start) * 3 / 4)
        self.folder.mkdir(parents=True, exist_ok=True)
        part = self.folder / f".{uuid.uuid4().hex}.part"
        digest = hashlib.sha256()
        try:
            with open(part, "wb") as out:
                for piece in base64_pieces(url, start):  # written as decoded, never held whole
                    digest.update(piece)
                    out.write(piece)
        except (binascii.Error, ValueError):  # a character that is no base64 (ASCII or not)
            part.unlink(missing_ok=True)
            raise bad("the video's data URL is not valid base64", "video_url") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        path = self.folder / (digest.hexdigest()[:32] + "." + kind.group(1).removeprefix("x-"))
        with self._lock:
            self._held[path] += 1
            if path.exists():
                part.unlink(missing_ok=True)
                used(path)  # the most recently asked about is kept longest
                return str(path)
        try:
            used(part)
            os.replace(part, path)
        except BaseException:
            part.unlink(missing_ok=True)
            self.release(str(path))
            raise
        self._forget_old()
        return str(path)

    def unnamed(self, message: str) -> str:
        """`message` with each path of this server's upload folder said as what it is: a client
        is not told where the server keeps uploads."""
        folder = re.escape(str(self.folder))
        return re.sub(folder + r"/[^\s'\"]*?(?=[\s'\",;:]|$)", "the video sent", message)

    def release(self, path: str) -> None:
        """A request is done with the video `path` names (an upload may go once none holds it)."""
        with self._lock:
            key = Path(path)
            if self._held.get(key, 0) > 1:
                self._held[key] -= 1
            else:
                self._held.pop(key, None)

    def too_large(self, size_bytes: float) -> None:
        limit = f"{self.max_upload_mb:g} MB"
        raise ApiError(
            413,
            f"the video is {size_bytes / 2**20:.1f} MB, over the {limit} limit (--max-upload-mb)",
            "request_too_large",
            "video_url",
        )

    def _forget_old(self) -> None:
        """Remove the oldest uploads beyond `KEEP_UPLOADS`, never one a request still holds."""
        with self._lock:
            saved = []
            for p in self.folder.glob("*.*"):
                with contextlib.suppress(OSError):  # removed meanwhile
                    saved.append((p.stat().st_atime, p))
            idle = [p for _, p in sorted(saved) if p not in self._held and p.suffix != ".part"]
            for old in idle[: max(0, len(idle) - KEEP_UPLOADS)]:
                old.unlink(missing_ok=True)
