"""The messages our processes send each other, and the one codec for them and for errors.

Four hops carry them: the frontend process and rank 0 (`runtime.launcher` / `runtime.socket_link`,
an authkeyed local socket), rank 0 and the other ranks (`runtime.control`, a gloo group), a rank and
its decode worker processes (`video.decode`, a pipe), and the ranks' agreement on an ingest error
(`video.ingest`). Each sends these frozen dataclasses through `encode` / `decode` (pickle, so a
request's arguments may be any picklable value: a config section, a request dataclass, frames).

An error crosses as a `Failure`: the names of its type and of that type's bases, and its one-line
message. On the other side `Failure.error` raises it again as the same type, or as the nearest base
that process knows, when the type is a `WireError` (every `EngineError` and `VideoError` is; a new
subclass crosses with no code here), so the user reads the same line wherever it was raised.

A leaf module: it imports nothing of ours, so every layer may use it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

__all__ = [
    "Failure",
    "Interrupt",
    "Message",
    "Piece",
    "Progress",
    "Ready",
    "Reply",
    "Request",
    "Warned",
    "WireError",
    "decode",
    "encode",
    "receive",
    "send",
]

_KNOWN: dict[str, type[WireError]] = {}  # every WireError type this process has defined, by name


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class WireError(Exception):
    """An error that crosses processes as its own type, rebuilt from its message alone (a subclass
    that needs more arrives as its nearest base that does not)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _KNOWN[_name(cls)] = cls


E = TypeVar("E", bound=BaseException)


@dataclass(frozen=True)
class Request:
    """Run `command` with `args` (frontend -> rank 0, rank 0 -> every rank, a rank -> a decode
    worker); `id` pairs it with its answer where several are in flight."""

    command: str
    args: dict[str, Any] = field(default_factory=dict)
    id: int = 0


@dataclass(frozen=True)
class Ready:
    """Rank 0's first message: its model is loaded; `info` is what `Engine.describe` returns."""

    info: dict[str, Any]


@dataclass(frozen=True)
class Progress:
    """How far a long request has come (frames decoded and encoded)."""

    stage: str
    done: int
    total: int


@dataclass(frozen=True)
class Piece:
    """The next piece of a streamed answer."""

    text: str


@dataclass(frozen=True)
class Reply:
    """A request's result (the last message of an answer: its stats)."""

    value: Any = None
    id: int = 0


@dataclass(frozen=True)
class Warned:
    """A warning raised where the user cannot see it, to be raised again where they can."""

    message: str


@dataclass(frozen=True)
class Interrupt:
    """Stop the answer being generated (sent by the frontend between its pieces)."""


@dataclass(frozen=True)
class Failure:
    """A request's error: its type's names (its own first, then its bases that are `WireError`s)
    and its message."""

    types: tuple[str, ...]
    message: str
    id: int = 0

    @classmethod
    def of(cls, exc: BaseException, *, id: int = 0, message: str | None = None) -> Failure:
        """`exc` as it crosses; `message` replaces its text (a decoder's error made one line)."""
        own = type(exc)
        bases = [c for c in own.__mro__[1:] if issubclass(c, WireError) and c is not WireError]
        text = str(exc) if message is None else message
        return cls(tuple(_name(c) for c in (own, *bases)), text, id)

    @property
    def name(self) -> str:
        """The type's own name, as a traceback's last line writes it ("VideoNotFoundError")."""
        return self.types[0].rpartition(".")[2]

    def error(self, within: type[E] = WireError) -> E | None:
        """The error as the type it was raised as (or its nearest base this process knows) when
        that is a `within`; None when it is not, or no `WireError` at all."""
        for name in self.types:
            cls = _KNOWN.get(name)
            if cls is not None and issubclass(cls, within):
                try:
                    return cls(self.message)
                except TypeError:  # made from more than a message: its nearest base will do
                    continue
        return None


Message = Union[Request, Ready, Progress, Piece, Reply, Warned, Interrupt, Failure]
_MESSAGES = (Request, Ready, Progress, Piece, Reply, Warned, Interrupt, Failure)


def encode(message: Message) -> bytes:
    """The bytes that carry `message` over any hop."""
    if not isinstance(message, _MESSAGES):
        raise TypeError(f"not a wire message: {message!r}")
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    """The message `encode` made of `data`."""
    message = pickle.loads(data)
    if not isinstance(message, _MESSAGES):
        raise TypeError(f"not a wire message: {type(message).__name__}")
    return message


def send(conn: Any, message: Message) -> None:
    """Send `message` over a `multiprocessing.connection.Connection` (a socket or a pipe)."""
    conn.send_bytes(encode(message))


def receive(conn: Any) -> Message:
    """The next message on `conn` (EOFError / OSError when the other side is gone)."""
    return decode(conn.recv_bytes())
