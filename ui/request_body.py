"""A request's JSON body, read as the memory budget allows: its size reserved before it is read
(by its Content-Length, or chunk by chunk when it has none), read no further than the upload limit,
held once (one buffer, emptied as the text is made), and a client that leaves while it sends is one
line."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request

from lvx_ui.api_errors import ApiError, bad
from lvx_ui.request_memory import BODY_COST, Reservation

GONE = "the client went away while it sent the body"


async def read_body(
    request: Request, limit: float, held: Reservation, too_large: Callable[[float], None]
) -> Any:
    """The parsed body; `too_large(bytes)` raises the refusal of a body past `limit` bytes (the
    body is read to its end first, kept nowhere: the client then reads the answer)."""
    size = int(request.headers.get("content-length", "0").strip() or 0)
    try:
        if size > limit:
            await _drain(request)
            too_large(size * 3 / 4)
        held.grow(size * BODY_COST, "the body")
        body = bytearray()
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                await _drain(request)
                too_large((len(body) + len(chunk)) * 3 / 4)
            if (len(body) + len(chunk)) * BODY_COST > held.taken:  # chunked: no length given
                held.grow(len(chunk) * BODY_COST, "the body")
            body += chunk
    except ClientDisconnect:
        raise ApiError(499, GONE, "client_closed") from None
    return parsed(body)


async def _drain(request: Request) -> None:
    async for _ in request.stream():
        pass


def parsed(body: bytearray) -> Any:
    """The JSON of `body` (emptied: the text and the parsed body are never held beside it)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the body is not UTF-8 JSON") from None
    finally:
        body.clear()
    try:
        return json.loads(text)
    except RecursionError:
        raise bad("the body is nested too deeply to be a chat request") from None
    except ValueError:
        raise bad("the body is not valid JSON") from None
