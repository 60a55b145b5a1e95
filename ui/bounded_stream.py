"""A streamed answer whose client stops reading cannot hold the engine: each piece must be taken by
the connection within a send timeout, else the stream ends there (its generator closed, so the
answer is cancelled and the engine freed) and the log says so, in the API's own line: uvicorn's
"returned without completing response" for that stream (it then closes the connection) would only
repeat it without the reason, so it is left out, and only for the streams ended so."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

UNFINISHED = "ASGI callable returned without completing response."  # uvicorn's words


class _StalledStreams(logging.Filter):
    """Drops uvicorn's line about an unfinished response once for each stream ended for its
    stalled client; any other unfinished response is still said."""

    def __init__(self) -> None:
        super().__init__()
        self.pending, self.lock = 0, threading.Lock()

    def ended(self) -> None:
        with self.lock:
            self.pending += 1

    def filter(self, record: logging.LogRecord) -> bool:
        with self.lock:
            if self.pending and record.getMessage() == UNFINISHED:
                self.pending -= 1
                return False
        return True


STALLED = _StalledStreams()
logging.getLogger("uvicorn.error").addFilter(STALLED)


class BoundedStreamingResponse(StreamingResponse):
    """`StreamingResponse` whose every send must finish within `send_timeout` seconds; past it,
    `stalled()` is called and the body's generator is closed (its `finally` runs)."""

    def __init__(self, *args, send_timeout: float, stalled: Callable[[], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout, self.stalled = send_timeout, stalled

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            with anyio.fail_after(self.send_timeout):
                await send(message)

        try:
            await super().stream_response(bounded)
        except TimeoutError:
            STALLED.ended()
            self.stalled()
            await self.body_iterator.aclose()  # the answer stops and the engine is freed now
