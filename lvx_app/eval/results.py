"""Append-only JSONL results: a header per session, then one record per answered question.

Every record is flushed and fsynced as soon as it is answered, so a crash or Ctrl-C loses nothing
already answered; a rerun with the same settings skips the question_ids already in the file. A torn
last line left by a crash is ignored when reading and cut off before appending. ``merge`` combines
shard files.

Lines::

    # each session start
    {"type": "header", "format": 1, "task": "videomme", "model": ..., "fps": ..., ...}
    {"type": "answer", "question_id": "001-1", "response": "B", "pred": "B", "correct": true, ...}
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

FORMAT = 1
# Settings that change the answers: a file is only resumed or merged when these agree.
COMPAT_KEYS = (
    "task",
    "model",
    "revision",
    "fps",
    "max_frames",
    "subtitles",
    "prompt_version",
    "max_new_tokens",
    "dataset_sha256",
)


class ResultsError(ValueError):
    """A results file cannot be resumed or merged; the message says why and what to do."""


@dataclass
class RunManifest:
    """What makes a number reproducible; written as the header line of every session."""

    model: str
    revision: str | None
    fps: float
    max_frames: int | None
    subtitles: str  # none | official (Video-MME's files) | speech (transcribed)
    prompt_version: str
    scoring: str
    max_new_tokens: int
    dataset_file: str
    dataset_sha256: str
    lvx_version: str
    durations: list[str] | None = None
    limit: int | None = None
    shard: str | None = None
    task: str = "videomme"
    engine: dict[str, Any] = field(default_factory=dict)  # what the engine reports about itself

    def header(self) -> dict[str, Any]:
        return {"type": "header", "format": FORMAT, **asdict(self), "started": _utc_now()}


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Results:
    headers: list[dict[str, Any]]
    records: list[dict[str, Any]]  # first record per question_id, file order
    duplicates: list[str] = field(default_factory=list)  # question_ids seen again in the same file
    torn_tail: bool = False  # the last line was cut short (a crash mid-write) and was ignored

    @property
    def done(self) -> set[str]:
        return {r["question_id"] for r in self.records}


def read_results(path: Path | str) -> Results:
    """Headers and answer records of a results file; a missing file reads as empty."""
    path = Path(path)
    res = Results(headers=[], records=[])
    if not path.exists():
        return res
    if path.is_dir():
        raise ResultsError(
            f"{path} is a folder; --out names a results file, e.g. {path / 'results.jsonl'}"
        )
    lines = path.read_bytes().split(b"\n")
    seen: set[str] = set()
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
            if not isinstance(item, dict):
                raise ValueError("not an object")
        except ValueError as e:
            if all(not rest.strip() for rest in lines[n:]):
                res.torn_tail = True  # only the last line may be torn
                break
            raise ResultsError(
                f"{path} line {n} is not a JSON record ({e}); the file was edited or corrupted."
            ) from None
        if item.get("type") == "header":
            res.headers.append(item)
        elif item.get("type") == "answer":
            qid = item["question_id"]
            if qid in seen:
                res.duplicates.append(qid)
            else:
                seen.add(qid)
                res.records.append(item)
    return res


def check_compatible(a: dict[str, Any], b: dict[str, Any], what_a: str, what_b: str) -> None:
    a, b = _subtitles_named(a), _subtitles_named(b)
    diffs = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in COMPAT_KEYS if a.get(k) != b.get(k)]
    if diffs:
        raise ResultsError(
            f"{what_a} and {what_b} were run with different settings ({'; '.join(diffs)}); "
            "use another --out, or rerun with the same settings."
        )


def _subtitles_named(header: dict) -> dict:
    """`header` with its subtitles as a name: a file written when they were on or off says
    true/false (the official setting, or none)."""
    value = header.get("subtitles")
    if isinstance(value, bool):
        return {**header, "subtitles": "official" if value else "none"}
    return header


def _cut_torn_tail(path: Path) -> None:
    """Drop a partial last line so the next append starts on a fresh line."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


class ResultsWriter:
    """Appends answer records to ``path``, each flushed and fsynced; knows which questions are done.

    Opening an existing file checks that it was written with compatible settings (``COMPAT_KEYS``).
    The session's header line is written just before its first record.
    """

    def __init__(self, path: Path | str, manifest: RunManifest):
        self.path = Path(path)
        self.manifest = manifest
        existing = read_results(self.path)
        if existing.headers:
            check_compatible(
                existing.headers[0], manifest.header(), f"results file {self.path}", "this run"
            )
        self.done: set[str] = existing.done
        self.previous = len(existing.records)
        self._f = None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self.path.exists():
                    _cut_torn_tail(self.path)
                self._f = open(self.path, "a", encoding="utf-8")
            except OSError as exc:
                why = exc.strerror or type(exc).__name__
                raise ResultsError(
                    f"{self.path} cannot be written ({why}); choose an --out you can write"
                ) from None
            self._append(self.manifest.header())
        self._append({"type": "answer", **record})
        self.done.add(record["question_id"])

    def _append(self, item: dict[str, Any]) -> None:
        assert self._f is not None
        self._f.write(json.dumps(item, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class MergeSummary:
    out: Path
    records: int
    per_input: dict[str, int]
    duplicates: list[str]  # question_ids found more than once (kept the first)


def merge_results(
    inputs: Sequence[Path | str], out: Path | str, keep_first: bool = False
) -> MergeSummary:
    """Combine shard files into ``out`` (written whole, then renamed into place).

    All inputs must share the settings in ``COMPAT_KEYS``. A question_id answered in more than one
    input is an error naming them, unless ``keep_first`` (then the first input's answer is kept).
    """
    out = Path(out)
    if not inputs:
        raise ResultsError("merge needs at least one results file.")
    if out.exists():
        raise ResultsError(f"{out} already exists; merge writes a new file, pick another name.")
    loaded = []
    for p in map(Path, inputs):
        if not p.is_file():
            raise ResultsError(f"{p} does not exist.")
        res = read_results(p)
        if not res.headers:
            raise ResultsError(f"{p} has no header line; it is not an lvx results file.")
        loaded.append((p, res))
    first_path, first = loaded[0]
    for p, res in loaded[1:]:
        check_compatible(first.headers[0], res.headers[0], str(first_path), str(p))
    where: dict[str, list[str]] = defaultdict(list)
    for p, res in loaded:
        for qid in [r["question_id"] for r in res.records] + res.duplicates:
            where[qid].append(str(p))
    dups = sorted(q for q, ps in where.items() if len(ps) > 1)
    if dups and not keep_first:
        shown = "; ".join(f"{q} in {', '.join(where[q])}" for q in dups[:5])
        raise ResultsError(
            f"{len(dups)} question(s) answered more than once "
            f"({shown}{' ...' if len(dups) > 5 else ''}); "
            "were the shards overlapping? Pass --keep-first to keep the first file's answer."
        )
    header = {**first.headers[0], "started": _utc_now(), "shard": None}
    header["merged_from"] = [{"path": str(p), "records": len(res.records)} for p, res in loaded]
    records: list[dict[str, Any]] = []
    kept: set[str] = set()
    for _, res in loaded:
        for r in res.records:
            if r["question_id"] not in kept:
                kept.add(r["question_id"])
                records.append(r)
    records.sort(key=lambda r: r["question_id"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for item in [header, *records]:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return MergeSummary(out, len(records), {str(p): len(r.records) for p, r in loaded}, dups)


VIDEO_FIELDS = ("video_id", "duration", "domain", "sub_category")
QUESTION_FIELDS = ("question_id", "task_type", "question", "options", "answer", "response")


def to_official_json(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in the official submission shape (``output_test_template.json``): a list of videos,
    each with its ``questions`` and their raw ``response``, ready for the official script or the
    leaderboard. Each video carries ``"missing": false`` so the script's ``skip_missing`` mode can
    read a partial run."""
    videos: dict[str, dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: r["question_id"]):
        v = videos.setdefault(
            r["video_id"], {k: r[k] for k in VIDEO_FIELDS} | {"missing": False, "questions": []}
        )
        v["questions"].append({k: r.get(k) for k in QUESTION_FIELDS})
    return list(videos.values())
