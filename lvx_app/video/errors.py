"""Errors a user can cause with a video, each one line that says what to do next.

Every class derives from `VideoError`, so the CLI and UI catch one type and print `str(err)`. The
message names the file (and, for decode failures, the time range) so nothing has to be guessed.
Raised in a decode worker or on another rank, one crosses to this process as its own type
(`lvx_app.wire`).
"""

from __future__ import annotations

from lvx_app.wire import WireError


class VideoError(WireError):
    """Base class: a problem with the video or the sampling settings, with a one-line fix in the
    message."""


class VideoNotFoundError(VideoError):
    """The path does not exist or is not a regular file."""


class NotAVideoError(VideoError):
    """The file exists but is no video container decord can open."""


class NoVideoStreamError(NotAVideoError):
    """A media file with no video stream (audio only, subtitles only)."""


class CorruptVideoError(VideoError):
    """A video that is empty, has no frames, or fails to decode (truncated or damaged)."""


class PlanTooLargeError(VideoError):
    """The sampling plan has more frames than --max-frames allows (in strict mode) or than memory
    holds."""


class DecodeTimeoutError(VideoError):
    """A decode worker made no progress within the per-chunk timeout and was killed."""


class RemoteRankError(VideoError):
    """Another rank of the worker group failed while ingesting; its message is repeated here."""


class VideoWarning(UserWarning):
    """A setting was adjusted (e.g. fps clamped to the video's own fps); the plan records it in
    `notes`."""
