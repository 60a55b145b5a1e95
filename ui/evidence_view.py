"""The page's view of an answer's evidence: each moment as a small thumbnail (a frame of the video
at the moment's start) with its time and share under the answer; a click seeks the player there,
by the same `#lvx-seek-` links that timestamps in answers use (`SEEK_JS` in ui/app.py)."""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Sequence

from lvx_app.engine.moments import TOP_MOMENTS, label
from lvx_app.engine.records import Moment

log = logging.getLogger("lvx.ui")

THUMB_WIDTH = 120  # pixels; a thumbnail is a reminder of the moment, not a view of it
# the chat shows a message's images large; an evidence thumbnail keeps its own small size, so the
# answer and the next question stay in view
THUMB_CSS = f"""
#lvx-chat a[href*="lvx-seek-"] img {{
  width: {THUMB_WIDTH}px !important; height: auto !important; max-height: none !important;
  min-width: 0 !important; min-height: 0 !important; display: inline-block; vertical-align: middle;
}}
"""


def thumbnails(path: str, times: Sequence[float], width: int = THUMB_WIDTH) -> list[str | None]:
    """A small JPEG data URI of the video's frame at each of `times` (seconds); None for each one
    when the video cannot be read (the moments are then shown as text links)."""
    if not times:
        return []
    try:  # PyAV, not decord: decord's threads abort the server process when it exits
        import av

        out: list[str | None] = []
        with av.open(path) as container:
            stream = container.streams.video[0]
            for t in times:
                out.append(_jpeg(_frame_at(container, stream, t), width))
        return out
    except Exception as exc:  # noqa: BLE001 - the answer is shown whatever happens to its thumbnails
        log.warning("no evidence thumbnails for %s: %s", path, exc)
        return [None] * len(times)


def _frame_at(container, stream, t: float):
    """The first frame at or after `t` seconds (the last frame before it when none is)."""
    container.seek(max(0, int(t / stream.time_base)), stream=stream, backward=True)
    frame = None
    for frame in container.decode(stream):
        if frame.time is not None and frame.time >= t - 1e-6:
            break
    if frame is None:
        raise ValueError(f"no frame at {t:.2f} s")
    return frame.to_image()


def _jpeg(image, width: int) -> str:
    height = max(1, round(image.height * width / image.width))
    buffer = io.BytesIO()
    image.resize((width, height)).save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def evidence_markdown(
    evidence: Sequence[Moment] | None, path: str, seek_prefix: str, top: int = TOP_MOMENTS
) -> str:
    """Markdown under an answer: "seen at" and the top moments, each a thumbnail and a caption
    (time, share) that both link to `seek_prefix` + the moment's start in seconds, which the
    page's click handler turns into a seek of the player; "" without evidence."""
    shown = list(evidence or [])[:top]
    if not shown:
        return ""
    cells = []
    for moment, image in zip(shown, thumbnails(path, [m.start for m in shown])):
        href = f"{seek_prefix}{moment.start:.2f}"
        caption = f"[{label(moment)} ({moment.share:.0%})]({href})"
        cells.append(f"[![{label(moment)}]({image})]({href}) {caption}" if image else caption)
    return "seen at: " + " · ".join(cells)
