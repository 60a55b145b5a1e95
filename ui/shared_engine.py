"""The one engine every browser tab of `lvx serve` uses, and what it holds now: whether its workers
are alive, whose video and whose conversation.

Requests reach it one at a time (one Gradio concurrency slot, and `lock`). Before a tab's question
it is brought to that tab (`ready_for`): a dead worker group is restarted with the same options
(`heal`), the tab's video is reloaded when another tab loaded its own since (from the feature cache,
with progress shown to that tab), and the tab's conversation is rebuilt from its turns when another
tab used the engine since (`Engine.replay`). Each step leaves a note for the answer's footer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lvx_app.engine.api import EngineError, GroupFailed, VideoSummary
from lvx_app.runtime.engine_handle import Engine
from lvx_ui.tabs import Tab, VideoSpec

NO_VIDEO = "load a video in this browser tab first: each tab asks about its own video"


class SharedEngine:
    """The engine, what it holds, and how to bring it back to a tab."""

    def __init__(self, engine: Engine, reopen: Callable[[], Engine] | None = None) -> None:
        self.engine = engine
        self.reopen = reopen  # a fresh engine with the same options, after the group died
        self.failed: str | None = None  # why the group died; the next request restarts it
        self.loaded: VideoSpec | None = None  # the video the engine holds
        self.talking: str | None = None  # the tab whose conversation the engine holds
        self.lock = threading.Lock()

    def fail(self, exc: BaseException) -> str | None:
        """For a dead group: remember it (the next request restarts it) and return the user's line;
        None for any other error (the caller words it)."""
        if not isinstance(exc, GroupFailed):
            return None
        self.failed, self.loaded, self.talking = str(exc), None, None
        return f"{exc}; the workers restart on the next request" if self.reopen else str(exc)

    def heal(self) -> str:
        """Restart a worker group that died (or was found dead); a note for the page, "" if it was
        alive."""
        dead = self.engine.dead()  # a group that exited meanwhile
        if dead and self.failed is None:
            self.fail(GroupFailed(dead))
        if self.failed is None:
            return ""
        if self.reopen is None:
            raise GroupFailed(self.failed)
        why = self.failed
        with contextlib.suppress(Exception):
            self.engine.close()
        self.engine = self.reopen()  # an error here leaves `failed` set: the next request retries
        self.failed = None
        return f"the workers restarted after: {why}"

    def lend(self) -> Engine:
        """The engine for a request from beside the page (the OpenAI-compatible API), with `lock`
        held; a dead group is restarted first. Each tab then reloads its video (from the feature
        cache) and rebuilds its conversation before its next answer."""
        self.heal()
        self.loaded, self.talking = None, None
        return self.engine

    def load(self, owner: str, spec: VideoSpec, progress: Any = None) -> VideoSummary:
        """Load tab `owner`'s video; its conversation starts afresh."""
        summary = self._load(spec, progress)
        self.talking = owner
        return summary

    def ready_for(self, owner: str, tab: Tab, progress: Any = None) -> list[str]:
        """Bring the engine to tab `owner`: its own video, then its own conversation. Returns notes
        of what that took; EngineError when the tab has no video."""
        if tab.video is None:
            raise EngineError(NO_VIDEO)
        notes = []
        if tab.video != self.loaded:
            name = Path(tab.video[0]).name
            try:
                summary = self._load(tab.video, progress)
            except GroupFailed:
                raise
            except EngineError as exc:
                raise EngineError(
                    f"your video {name} could not be loaded again ({exc}); load it again"
                ) from None
            cached = " from the feature cache" if summary.from_cache else ""
            notes.append(f"reloaded your video {name}{cached}")
        if self.talking != owner:
            self.engine.reset()
            self.talking = None
            if tab.turns:
                self.engine.replay(tab.turns)
                n = len(tab.turns)
                notes.append(
                    f"your conversation was rebuilt from its {n} earlier turn{'s' * (n > 1)}: "
                    "another tab used the model in between"
                )
            self.talking = owner
        return notes

    def left(self, owner: str) -> None:
        """Tab `owner`'s conversation on the engine no longer matches its turns (a reset, an answer
        that did not finish): its next question starts from its turns."""
        if self.talking == owner:
            self.talking = None

    def _load(self, spec: VideoSpec, progress: Any) -> VideoSummary:
        path, fps, cap, cues = spec
        self.loaded, self.talking = None, None  # a failed load may leave no video loaded
        summary = self.engine.load_video(
            path, subtitles=list(cues), progress=progress, fps=fps, max_frames=cap
        )
        self.loaded = spec
        return summary
