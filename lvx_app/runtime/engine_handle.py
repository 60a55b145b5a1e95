"""The `Engine` a frontend holds: the same calls whether the ranks run in this process or under
torchrun.

    import lvx_app as lvx
    with lvx.open("mPLUG/mPLUG-Owl3-7B-241101", gpus=8) as engine:
        engine.load_video("movie.mp4", fps=1)
        for piece in engine.ask("What happens after the storm?"):
            print(piece, end="")
        print(engine.last_answer)

`load_video` and `ask` take the fields of the video and generation options as keyword overrides of
the engine's config (`fps=`, `max_frames=`, `kv_mode=`, ...; `max_new_tokens=`, `temperature=`,
...): a load is one `VideoRequest`, which the engine keeps as `held`. Subclasses
carry the commands: `GroupDriver` runs them here (this process is rank 0), `RemoteEngine` sends them
to rank 0 of a torchrun group.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lvx_app.config import Config, ConfigError, VideoConfig, updated
from lvx_app.engine.limits import MAX_QUESTION_CHARS, too_many_chars
from lvx_app.engine.records import (
    AnswerStats,
    EngineError,
    EngineWarning,
    ProgressFn,
    QuestionTooLong,
    VideoRequest,
    VideoSummary,
)
from lvx_app.runtime.commands import ASK, CHAT, LOAD_VIDEO, REPLAY, RESET, STATS, Command
from lvx_models.api import valid_text


class Engine:
    """A model held by a group of ranks, one video and one conversation at a time."""

    config: Config
    last_answer: AnswerStats | None = None
    held: VideoRequest | None = None  # the video the ranks hold, as it was asked for (None: none)
    loaded: VideoSummary | None = None  # what its load made (its transcript, for /transcript)
    closed: bool = False  # set by `close`: its ranks are gone, no command reaches them

    def load_video(
        self, video: str | VideoRequest, *, progress: ProgressFn | None = None, **options: Any
    ) -> VideoSummary:
        """Make the video resident (decode and encode, or the caches) and prefill its prompt; the
        conversation starts afresh. `video`: a `VideoRequest`, or a path with the keyword
        overrides of the config's video options (`fps=`, `kv_mode=`, ...), `subtitles=` (auto,
        none, a FILE, or the cues themselves; [] for none) and `opening=` (what `chat`
        conversations say before the video). `progress(stage, done, total)` is called as frames
        arrive."""
        if isinstance(video, VideoRequest):
            if options:
                raise EngineError(f"give {', '.join(options)} in the VideoRequest, not beside it")
            request = video
        else:
            request = _request(self.config.video, video, options)
        track = request.subtitle_track()  # read here: the ranks get the cues
        resolved = request.resolved(track)  # and whether they transcribe its speech
        for note in track.notes:
            warnings.warn(note, EngineWarning, stacklevel=2)
        self.held = self.loaded = None  # a failed load may have dropped the video held before
        summary: VideoSummary = self._one_call(LOAD_VIDEO, progress, request=resolved)
        self.held, self.loaded = request, summary
        summary.subtitle_source = track.source or summary.subtitle_source
        return summary

    def ask(self, question: str, **generation: Any) -> Iterator[str]:
        """Stream the answer as text pieces; `last_answer` holds its stats afterwards. A question
        longer than any the model could take is refused here, before it reaches a rank."""
        question = _text(question, "the question")
        self.check_question(question)
        options = _overridden(self.config.generation, generation)
        return self._one_stream(ASK, question=question, generation=options)

    def chat(self, turns: Sequence[dict], **generation: Any) -> Iterator[str]:
        """Stream the answer to the last user message of a whole conversation (`turns`: the
        {"role", "content"} of each message; the first user message may hold the loaded video as
        `<|video|>`); the ranks keep the longest prefix of it they hold and prefill only the rest.
        `last_answer.prefill_tokens` says how many tokens that was."""
        options = _overridden(self.config.generation, generation)
        turns = [
            {"role": str(t["role"]), "content": _text(t["content"], "a message's content")}
            for t in turns
        ]
        self.check_question("".join(t["content"] for t in turns))
        return self._one_stream(CHAT, turns=turns, generation=options)

    def check_question(self, question: str) -> None:
        """Raise QuestionTooLong (one line) for a question of more characters than the model could
        take (`lvx_app.engine.limits.question_char_limit`): no rank tokenizes or receives it."""
        limit = self.describe().get(MAX_QUESTION_CHARS)
        if isinstance(limit, int) and len(question) > limit:
            raise QuestionTooLong(too_many_chars(len(question), limit))

    def reset(self, keep_prompt: bool = True) -> None:
        """Forget the conversation, keep the video; `keep_prompt=False` also drops its prompt
        from the cache (prefilled again by the next turn that shows the video)."""
        self._one_call(RESET, None, keep_prompt=keep_prompt)

    def replay(self, turns: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Rebuild a conversation after the video prompt from its turns (question, the answer's
        `last_answer.tokens`), generating nothing: it goes on as if it had never been left."""
        turns = [(_text(question, "a question"), answer) for question, answer in turns]
        for question, _ in turns:
            self.check_question(question)
        self._one_call(REPLAY, None, turns=[(q, [int(t) for t in answer]) for q, answer in turns])

    def describe(self) -> dict[str, Any]:
        """The model and the group: checkpoint, world size, device, dtype, layout, the longest
        question (characters)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Memory per rank, prompt and text tokens, timings."""
        return self._one_call(STATS, None)

    def interrupt(self) -> None:
        """Stop the answer being generated (safe from a signal handler or another thread)."""
        raise NotImplementedError

    def close(self) -> None:
        """Shut the ranks down."""
        raise NotImplementedError

    def abort(self) -> None:
        """Stop the ranks now, even mid-command (Ctrl-C while a video loads)."""
        self.close()

    def dead(self) -> str | None:
        """Why the ranks have already exited, if they have; None while they run (always, for ranks
        in this process)."""
        return None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one command at a time -------------------------------------------------------------------
    def _one_call(self, command: Command, progress: ProgressFn | None, **args: Any) -> Any:
        with _alone(self):
            return self.call(command, progress, **args)

    def _one_stream(self, command: Command, **args: Any) -> Iterator[str]:
        """The stream, holding the engine from its first piece to its end (or until it is closed:
        a stream dropped half-read gives the engine back)."""
        with _alone(self):
            yield from self.stream(command, **args)

    # ---- what a transport provides -------------------------------------------------------------
    def call(self, command: Command, progress: ProgressFn | None, **args: Any) -> Any:
        """Run `command` on every rank; rank 0's result (`progress` gets its progress messages)."""
        raise NotImplementedError

    def stream(self, command: Command, **args: Any) -> Iterator[str]:
        """Run a streaming `command` on every rank; rank 0's pieces as they come."""
        raise NotImplementedError


_LOCKS = threading.Lock()  # guards the making of an engine's own lock


@contextmanager
def _alone(engine: Engine) -> Iterator[None]:
    """Run one command of `engine` with no other running: the ranks take one at a time, and a
    second thread's command sent beside the first would leave them out of step (a hang, then the
    group killed). A thread that finds the engine busy is told so in one line."""
    if engine.closed:
        raise EngineError("this engine is closed; open another (lvx.open) to go on")
    with _LOCKS:
        lock = engine.__dict__.setdefault("_busy", threading.Lock())
    if not lock.acquire(blocking=False):
        raise EngineError(
            "the engine is busy with another call (another thread, or an answer not yet read to "
            "its end); wait for it, or open one engine per thread"
        )
    try:
        yield
    finally:
        lock.release()


def _text(value: Any, what: str) -> str:
    """`value` as valid Unicode text (a lone surrogate becomes U+FFFD); bytes or another type is an
    EngineError, never sent to a rank."""
    if not isinstance(value, str):
        hint = "; decode it first (bytes.decode())" if isinstance(value, (bytes, bytearray)) else ""
        raise EngineError(f"{what} must be text (str), not {type(value).__name__}{hint}")
    return valid_text(value)


def _overridden(options: Any, changes: dict[str, Any]) -> Any:
    """`options` (a config section) with a call's keyword overrides; a bad one is an EngineError."""
    try:
        return updated(options, **changes)
    except ConfigError as exc:
        raise EngineError(str(exc)) from None


def _request(video: VideoConfig, path: str, options: dict[str, Any]) -> VideoRequest:
    """The request a call's path and keyword overrides make; a bad one is an EngineError."""
    try:
        return VideoRequest.of(path, video, **options)
    except ConfigError as exc:
        raise EngineError(str(exc)) from None
