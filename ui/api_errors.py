"""The one error of the OpenAI-compatible API: an HTTP status and the one line the client sees, in
OpenAI's error shape."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """A request the API refuses: `status` and one line that says what to do."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status)
        kind = kind or ("server_error" if self.status >= 500 else "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)
