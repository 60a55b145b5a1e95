"""The page's file route serves regular files only.

Gradio's `/gradio_api/file=PATH` opens whatever an allowed path names: a FIFO there blocks the
request (and a worker thread) until someone writes into it, a device or a folder fails with a
traceback. This middleware answers any path that exists and is not a regular file with one 404
line before Gradio's route sees it; everything else passes through untouched.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Callable
from urllib.parse import unquote

FILE_ROUTES = ("/gradio_api/file=", "/file=")
REFUSED = b'{"detail": "not a regular file: the page serves files only"}'


UNOPENABLE = (errno.ENAMETOOLONG, errno.ELOOP)  # Gradio's route would fail with a traceback


def special_file(path: str) -> bool:
    """Whether `path` exists and is not a regular file (a FIFO, a socket, a device, a folder), or
    names nothing that could be opened (a name too long, a loop of links)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return exc.errno in UNOPENABLE  # missing or unreadable: Gradio's route says so itself
    except ValueError:
        return False
    return not stat.S_ISREG(mode)


class RegularFilesOnly:
    """ASGI middleware: a file route naming anything but a regular file is a 404 line."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") == "http":
            route = scope.get("path", "")
            for prefix in FILE_ROUTES:
                if route.startswith(prefix) and special_file(unquote(route[len(prefix) :])):
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 404,
                            "headers": [(b"content-type", b"application/json")],
                        }
                    )
                    await send({"type": "http.response.body", "body": REFUSED})
                    return
        await self.app(scope, receive, send)
