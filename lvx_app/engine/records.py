"""The errors and records of the engine, the same on every rank and in the frontend process."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from lvx_app.config import ConfigError, VideoConfig, load_key, updated
from lvx_app.speech.audio import SpeechError
from lvx_app.speech.choice import wants_speech
from lvx_app.subtitles import Cue, SubtitleError, SubtitleTrack, resolve_subtitles
from lvx_app.video.plan import format_timestamp
from lvx_app.wire import WireError

ProgressFn = Callable[[str, int, int], None]  # (stage, done, total)


class EngineError(WireError, RuntimeError):
    """A failure the user can act on; its message is shown as is. It reaches the frontend process
    as its own type (`lvx_app.wire`)."""


class GroupFailed(EngineError):
    """The worker group died (a rank failed or the group exited): this engine cannot answer any
    more."""


class QuestionTooLong(EngineError):
    """A question over the cap, refused on every rank before any prefill: the engine answers the
    next one."""


class EngineWarning(UserWarning):
    """A warning raised on rank 0 of a worker group (an fps clamped, a prompt beyond the trained
    length), re-raised in the frontend process so the user sees it: the ranks' own output goes to
    the group log."""


@dataclass
class VideoSummary:
    path: str
    frames: int
    fps: float
    duration_s: float
    visual_tokens: int
    from_cache: bool
    seconds: float
    timestamps: list[float] = field(default_factory=list)
    subtitle_lines: int = 0  # subtitle lines placed in the video prompt
    subtitles_dropped: int = 0  # lines at the sampled frames left out to fit the token budget
    prompt_from_cache: bool = False  # the prefilled video prompt was read back
    prompt_tokens: int = 0  # the video prompt's tokens: prefilled by this load unless read back
    # the visual K/V were read back (lvx_app.engine.resident_visual_kv)
    visual_kv_from_cache: bool = False
    subtitle_source: str = ""  # where the subtitles were found ("" = given as cues, or none)
    # the visual K/V mode and how it was decided (`kv_choice.KvChoice.as_dict`: auto's figures)
    kv_choice: dict[str, Any] = field(default_factory=dict)
    # the cues transcribed from the video's speech (`--subtitles auto|speech`); [] when none were
    transcript: list[Cue] = field(default_factory=list)
    transcript_from_cache: bool = False  # read back from the cache, the speech model never ran

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VideoOpening:
    """What comes before the video in a conversation: the system message ("" is the empty one the
    chat template writes anyway) and the text before the video in the first user message."""

    system: str = ""
    before: str = ""
    # whose words these are (a client of the engine service; "" for none, or for words every
    # client shares): a load is reused, in memory or from the saved prompts, only by its owner,
    # so no client's time to answer tells what another wrote
    owner: str = ""

    def owned_by(self, client: str) -> VideoOpening:
        """This opening as `client`'s when it holds words of theirs (a system message, text
        before the video); as it is when it holds none."""
        return replace(self, owner=client) if self.system or self.before else self


@dataclass(frozen=True)
class VideoRequest:
    """One load of a video, as every frontend asks for it and as the engine holds it: the file,
    its options (the config's video section with this load's changes), its subtitles and what the
    conversation says before it. The ranks read every per-video choice from it."""

    path: str
    video: VideoConfig
    cues: tuple[Cue, ...] | None = None  # the subtitle cues to place; None: as video.subtitles says
    opening: VideoOpening = VideoOpening()
    speech: bool = False  # the ranks transcribe its speech into the cues (`resolved`)

    @classmethod
    def of(
        cls,
        path: str | Path,
        video: VideoConfig,
        *,
        subtitles: str | os.PathLike | Sequence[Cue] | None = None,
        opening: VideoOpening | None = None,
        **changes: Any,
    ) -> VideoRequest:
        """The request for `path` with `video`'s options and `changes` to them, each checked as
        the command line's is (a ConfigError line); `subtitles`: auto, none or a FILE (the option),
        or the cues themselves ([] for none)."""
        named = isinstance(subtitles, (str, os.PathLike))
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"the video takes a file's path, not {path!r:.40}")
        if not (subtitles is None or named or _cues(subtitles)):
            raise ConfigError(
                "subtitles takes auto, none, a subtitle file's path or a list of cues, "
                f"not {subtitles!r:.40}"
            )
        if named:
            changes["subtitles"] = str(subtitles)
        cues = None if subtitles is None or named else tuple(subtitles)
        return cls(str(path), updated(video, **changes), cues, opening or VideoOpening())

    @property
    def key(self) -> tuple:
        """What makes two requests the same load (the options that change what is loaded)."""
        return self.path, load_key(self.video), self.cues, self.opening

    def subtitle_track(self) -> SubtitleTrack:
        """The cues to place and where they came from: those given, else what `video.subtitles`
        (auto|speech|none|FILE) finds; a file that cannot be used is an EngineError line."""
        if self.cues is not None:
            return SubtitleTrack(list(self.cues))
        v = self.video
        try:
            return resolve_subtitles(self.path, v.subtitles, v.subtitle_lang, v.subtitle_encoding)
        except SubtitleError as exc:
            raise EngineError(str(exc)) from None

    def resolved(self, track: SubtitleTrack) -> VideoRequest:
        """This request with `track`'s cues: what the ranks load (they read no subtitle file), and
        whether they transcribe its speech (`--subtitles speech`, or auto with no subtitles found;
        a note may be added to `track`). Speech asked for without the extra is an EngineError
        line."""
        if self.cues is not None:  # given by the caller (with whether to transcribe)
            return replace(self, cues=tuple(track.cues))
        try:
            speech = wants_speech(self.path, self.video.subtitles, track)
        except SpeechError as exc:
            raise EngineError(str(exc)) from None
        if speech and self.video.subtitles.strip().lower() == "speech":
            track.notes += self._replaced()
        return replace(self, cues=tuple(track.cues), speech=speech)

    def _replaced(self) -> list[str]:
        """The line `--subtitles speech` adds when the video has subtitles it sets aside."""
        v = self.video
        try:
            found = resolve_subtitles(self.path, "auto", v.subtitle_lang, v.subtitle_encoding)
        except SubtitleError:
            return []
        if not found.source:
            return []
        return [f"--subtitles speech: the speech is transcribed in place of {found.source}"]


@dataclass(frozen=True)
class Moment:
    """Neighbouring sampled frames an answer looked at (lvx_app/engine/moments.py): from the first
    frame's time to the last's, in seconds into the video, and their summed share of the answer's
    visual attention (0..1)."""

    start: float
    end: float
    share: float


TOP_MOMENTS = 3  # moments shown under an answer


def label(moment: Moment) -> str:
    """ "12:31–12:40" for a span, "47:02" for one time."""
    first, last = format_timestamp(moment.start), format_timestamp(moment.end)
    return first if first == last else f"{first}–{last}"


def seen_line(evidence: Sequence[Moment], top: int = TOP_MOMENTS) -> str:
    """`seen at 12:31–12:40 (34%), 47:02 (12%)`: the top moments; "" without any."""
    if not evidence:
        return ""
    shown = ", ".join(f"{label(m)} ({m.share:.0%})" for m in evidence[:top])
    return f"seen at {shown}"


@dataclass
class AnswerStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # of the prompt tokens, those this answer fed (the rest were held)
    new_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    interrupted: bool = False
    truncated: bool = False
    context_full: bool = False  # truncated by the model's last position, not by max_new_tokens
    # the answer's token ids as the conversation holds them (a stop token left out): what
    # `Engine.replay` feeds to rebuild the conversation
    tokens: list[int] = field(default_factory=list, repr=False)
    # where in the video the answer looked, largest share first (None: not asked for, or not known)
    evidence: list[Moment] | None = None
    # transcript lines placed with the question (those sharing its words that the video prompt
    # lacked: lvx_app/engine/question_lines.py)
    transcript_lines: int = 0

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s}

    @property
    def footer(self) -> str:
        """TTFT, tokens/s, tokens and how the answer ended, in one line."""
        ended = ""
        if self.interrupted:
            ended = " · interrupted"
        elif self.context_full:
            ended = " · hit the end of the model's context (reset to go on)"
        elif self.truncated:
            ended = " · hit --max-new-tokens"
        n, lines = self.transcript_lines, ""
        if n:
            lines = f" · {n} transcript line{'s' * (n > 1)} matching the question placed"
        return (
            f"TTFT {self.ttft_s:.2f} s · {self.tokens_per_s:.1f} tok/s · "
            f"{self.new_tokens} tokens{ended}{lines}"
        )

    def __str__(self) -> str:
        """What `lvx chat` prints under an answer: where in the video it looked, then its
        numbers."""
        return "\n".join(line for line in (seen_line(self.evidence or []), self.footer) if line)


def _cues(given: Any) -> bool:
    """Whether `given` is the cues themselves: a list (or tuple) of `Cue`s."""
    return isinstance(given, (list, tuple)) and all(isinstance(c, Cue) for c in given)
