"""One-line descriptions of a loaded video and of the last answer, shared by the terminal chat and
the browser."""

from __future__ import annotations

import re

from lvx_app.engine.records import AnswerStats, VideoSummary

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but newline and tab
ECHO_CHARS = 200  # a question echoed back is cut to this many characters


def printable(text: str) -> str:
    """`text` with each control character a model may emit (backspace, escape, ...) shown as a
    visible escape (`\\x13`), so it can neither garble the terminal nor vanish: every frontend
    prints answers through it. Newlines and tabs stay as they are."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # line breaks too


def one_line(text: str) -> str:
    """`text` for a log line or a terminal: every control character (newline, escape, ...)
    shown as a visible escape (`\\n`, `\\x1b`), so text a client sent can neither forge a line
    nor recolour the operator's terminal."""
    return _ANY_CONTROL.sub(lambda found: _escape(found.group()), text)


def _escape(char: str) -> str:
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    code = ord(char)
    return named.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shortened(text: str, keep: int = ECHO_CHARS) -> str:
    """`text`, or its first `keep` characters and its length: a pasted book is not printed back."""
    if len(text) <= keep:
        return text
    return f"{text[:keep]}… ({len(text):,} characters)"


def sampled_rate(summary: VideoSummary) -> str:
    """The rate the frames were taken at: the asked fps, or less where --max-frames thinned them
    (3 frames over 12 s is 0.25 fps, whatever --fps said)."""
    if summary.duration_s > 0 and summary.frames / summary.duration_s < summary.fps:
        return f"{summary.frames / summary.duration_s:.2g}"
    return f"{summary.fps:g}"


def placed_line(summary: VideoSummary, source: str) -> str:
    """How many subtitle lines the prompt holds and where they came from: a file, a stream, or the
    speech model (and whether its transcript was read back from the cache)."""
    if summary.transcript:
        cached = ", read back from the cache" if summary.transcript_from_cache else ""
        return (
            f"{summary.subtitle_lines} of {len(summary.transcript)} transcript line(s) placed, "
            f"from {source}{cached}"
        )
    return f"{summary.subtitle_lines} line(s) at the sampled frames, from {source}"


def describe_video(summary: VideoSummary) -> str:
    source = "from cache" if summary.from_cache else f"in {summary.seconds:.1f} s"
    subtitles = (
        f", {summary.subtitle_lines} subtitle line(s) placed" if summary.subtitle_lines else ""
    )
    if summary.prompt_from_cache:
        kv = " and visual K/V" if summary.visual_kv_from_cache else ""
        source = f"from cache with its saved prompt{kv} in {summary.seconds:.1f} s"
    return (
        f"{summary.frames} frames at {sampled_rate(summary)} fps over {summary.duration_s:.0f} s, "
        f"{summary.visual_tokens:,} visual tokens{subtitles}, loaded {source}"
    )


def describe_answer(s: AnswerStats | None) -> str:
    """TTFT, tokens/s, tokens and how the answer ended, in one line."""
    return s.footer if s is not None else ""
