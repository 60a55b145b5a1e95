"""What the page keeps for each browser tab: its video, its conversation and its Stop button.

The server has one engine, holding one video and one conversation at a time, and every tab uses it
in turn. A tab keeps what it loaded and what it was answered (each question with the token ids of
its answer), so that when another tab used the engine in between, its next question first gets its
own video back and its conversation rebuilt exactly (`lvx_ui.shared_engine`). Its Stop button stops
only its own answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from lvx_app.engine.api import VideoSummary

MAX_TABS = 256  # browser tabs remembered; the one unused longest is forgotten first

# (path, fps, max frames, subtitle cues) as a tab loaded it
VideoSpec = tuple[str, float, int | None, tuple]


@dataclass
class Tab:
    """One browser tab's own state."""

    video: VideoSpec | None = None  # None: nothing loaded in this tab (or forgotten)
    summary: VideoSummary | None = None  # what its load said
    turns: list[tuple[str, list[int]]] = field(default_factory=list)  # (question, answer ids)
    stop: threading.Event = field(default_factory=threading.Event)  # its Stop button

    def start_over(self) -> None:
        """Forget the conversation (Reset, or a chat the browser cleared); keep the video."""
        self.turns = []


class Tabs:
    """The tabs the page remembers, by the id each keeps in its page state."""

    def __init__(self, limit: int = MAX_TABS) -> None:
        self.limit = limit
        self._tabs: OrderedDict[str, Tab] = OrderedDict()
        self._lock = threading.Lock()  # Stop arrives outside the engine's queue

    def __getitem__(self, owner: str) -> Tab:
        """Tab `owner`, now the most recently used (a new one the first time, or once forgotten)."""
        with self._lock:
            tab = self._tabs.pop(owner, None) or Tab()
            self._tabs[owner] = tab
            while len(self._tabs) > self.limit:
                self._tabs.popitem(last=False)
            return tab

    def stop(self, owner: str | None) -> None:
        """Press tab `owner`'s Stop button: only its own answer stops."""
        with self._lock:
            tab = self._tabs.get(owner) if owner else None
        if tab is not None:
            tab.stop.set()
