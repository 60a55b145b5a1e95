"""A mini Video-MME in the official layout, and a deterministic test session (a test double, not
product code).

root/videomme/test-00000-of-00001.parquet   the official columns, options "A. …"
root/data/<videoID>.mp4 | .MP4 | .mkv        tiny generated clips (PyAV, 2 s, 32x24)
root/subtitle/<videoID>.srt                  overlapping cues, <font> tags, CRLF
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lvx_app.engine.records import VideoRequest
from lvx_app.eval.runner import VideoInfo
from lvx_app.video.synthetic import make_video

# the clips are written and read with PyAV: without it (a bare GPU image) the files using these
# fixtures skip instead of failing to import
av = pytest.importorskip("av")

# (video_id, videoID, duration, domain, sub_category, file extension or None when the video is
# missing)
VIDEOS = [
    ("001", "vidShortAAA", "short", "Knowledge", "Astronomy", ".mp4"),
    ("002", "vidShortBBB", "short", "Sports Competition", "Football", ".MP4"),
    ("003", "vidMediumCC", "medium", "Film & Television", "Animation", ".mkv"),
    ("004", "vidLongDDDD", "long", "Knowledge", "Geography", ".mp4"),
    ("005", "vidMissingE", "long", "Life Record", "Travel", None),
]
TASKS = ["Counting Problem", "Object Recognition", "OCR Problems"]

SRT = (
    '1\r\n00:00:00,000 --> 00:00:01,200\r\n<font color="white" size=".72c">hello and '
    "welcome</font>\r\n\r\n"
    '2\r\n00:00:00,800 --> 00:00:02,000\r\n<font color="white" size=".72c">to the tiny</font>\r\n'
    '<font color="white" size=".72c">test video</font>\r\n\r\n'
    '3\r\n00:00:05,000 --> 00:00:06,000\r\n<font color="white" size=".72c">never sampled</font>\r\n'
)


def question_rows(videos=VIDEOS) -> list[dict]:
    rows = []
    for vid, key, duration, domain, sub, _ in videos:
        for n, task in enumerate(TASKS, start=1):
            answer = "ABCD"[(int(vid) + n) % 4]
            rows.append(
                {
                    "video_id": vid,
                    "duration": duration,
                    "domain": domain,
                    "sub_category": sub,
                    "url": f"https://www.youtube.com/watch?v={key}",
                    "videoID": key,
                    "question_id": f"{vid}-{n}",
                    "task_type": task,
                    "question": f"Question {n} about video {vid}?",
                    "options": [
                        f"A. red {vid}.",
                        f"B. green {vid}.",
                        f"C. blue {vid}.",
                        f"D. black {vid}.",
                    ],
                    "answer": answer,
                }
            )
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_video(
    path: Path, seconds: float = 2.0, fps: int = 4, size: tuple[int, int] = (32, 24)
) -> Path:
    """A tiny index-carrying clip (mpeg4, so .mkv/.mp4/.MP4 all hold it)."""
    return make_video(path, int(seconds * fps), fps, size[0], size[1], codec="mpeg4")


@dataclass
class MiniVideoMME:
    root: Path
    question_file: Path
    rows: list[dict]
    missing: list[str]


def make_mini_videomme(root: Path, videos=VIDEOS) -> MiniVideoMME:
    rows = question_rows(videos)
    qfile = write_parquet(rows, root / "videomme" / "test-00000-of-00001.parquet")
    for _, key, *_, ext in videos:
        if ext:
            write_video(root / "data" / f"{key}{ext}")
    (root / "subtitle").mkdir(parents=True, exist_ok=True)
    (root / "subtitle" / f"{videos[0][1]}.srt").write_bytes(SRT.encode())
    return MiniVideoMME(root, qfile, rows, [key for _, key, *_, ext in videos if not ext])


@dataclass
class LookupSession:
    """Test double for EvalSession: answers from a table keyed by question text; records every call.

    ``fail_after`` raises from the (k+1)-th ask, simulating a crash or Ctrl-C mid-run."""

    answers: dict[str, str]
    default: str = "I am not sure."
    fail_after: int | None = None
    fail_with: type[BaseException] = RuntimeError
    calls: list[tuple] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)
    loaded: str | None = None

    def load_video(self, request: VideoRequest) -> VideoInfo:
        assert self.loaded is None, "load_video on a session that was not reset"
        path, fps, max_frames = request.path, request.video.fps, request.video.max_frames
        with av.open(path) as c:
            stream = c.streams.video[0]
            duration = (
                float(stream.duration * stream.time_base)
                if stream.duration
                else float(c.duration / 1e6)
            )
        times = [i / fps for i in range(int(duration * fps + 1e-9))]
        if max_frames and len(times) > max_frames:
            times = [times[int((j + 0.5) * len(times) / max_frames)] for j in range(max_frames)]
        self.loaded = path
        self.calls.append(("load_video", Path(path).name, fps, max_frames))
        return VideoInfo(timestamps=times, duration_s=duration, extra={"test": True})

    def ask(self, prompt: str, max_new_tokens: int) -> str:
        assert self.loaded is not None, "ask without a loaded video"
        if self.fail_after is not None and len(self.asked) >= self.fail_after:
            raise self.fail_with("simulated failure")
        question = next(line for line in prompt.split("\n") if line.startswith("Question "))
        self.asked.append(question)
        self.calls.append(("ask", question))
        return self.answers.get(question, self.default)

    def reset(self) -> None:
        self.loaded = None
        self.calls.append(("reset",))


def answers_for(rows: list[dict], right: set[str] | None = None) -> dict[str, str]:
    """Reply tables: the right letter for question_ids in ``right`` (all when None), else a wrong
    one."""
    out = {}
    for r in rows:
        ok = right is None or r["question_id"] in right
        letter = r["answer"] if ok else "ABCD"[("ABCD".index(r["answer"]) + 1) % 4]
        out[r["question"]] = f"{letter}."
    return out
