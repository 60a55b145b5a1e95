"""Video-MME questions in the official layout, validated, with their videos located and a run's
selection.

``--data DIR`` is laid out as the Hugging Face ``lmms-lab/Video-MME`` dataset unpacks::

    DIR/videomme/test-*.parquet      2,700 questions (or a JSON file: `find_question_file`)
    DIR/data/<videoID>.mp4           also .MP4 / .mkv; VLMEvalKit's DIR/video/ is searched too
    DIR/subtitle/<videoID>.srt       optional
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

DURATIONS = ("short", "medium", "long")
DOMAINS = (
    "Knowledge",
    "Film & Television",
    "Sports Competition",
    "Artistic Performance",
    "Life Record",
    "Multilingual",
)
SUB_CATEGORIES = (
    "Humanity & History",
    "Literature & Art",
    "Biology & Medicine",
    "Finance & Commerce",
    "Astronomy",
    "Geography",
    "Law",
    "Life Tip",
    "Technology",
    "Animation",
    "Movie & TV Show",
    "Documentary",
    "News Report",
    "Esports",
    "Basketball",
    "Football",
    "Athletics",
    "Other Sports",
    "Stage Play",
    "Magic Show",
    "Variety Show",
    "Acrobatics",
    "Handicraft",
    "Food",
    "Fashion",
    "Daily Life",
    "Travel",
    "Pet & Animal",
    "Exercise",
    "Multilingual",
)
TASK_TYPES = (
    "Temporal Perception",
    "Spatial Perception",
    "Attribute Perception",
    "Action Recognition",
    "Object Recognition",
    "OCR Problems",
    "Counting Problem",
    "Temporal Reasoning",
    "Spatial Reasoning",
    "Action Reasoning",
    "Object Reasoning",
    "Information Synopsis",
)

REQUIRED_FIELDS = (
    "video_id",
    "videoID",
    "duration",
    "domain",
    "sub_category",
    "task_type",
    "question_id",
    "question",
    "options",
    "answer",
)
VIDEO_DIRS = ("data", "video", "videos")
VIDEO_EXTENSIONS = (".mp4", ".MP4", ".mkv")
SUBTITLE_DIRS = ("subtitle", "subtitles")


class DatasetError(ValueError):
    """The question file or the data folder is not usable; the message says what to fix."""


@dataclass(frozen=True)
class Question:
    """One Video-MME question; field names follow the official file (``videoID`` is the file
    stem)."""

    question_id: str
    video_id: str
    videoID: str  # noqa: N815 - the official column name
    duration: str
    domain: str
    sub_category: str
    task_type: str
    question: str
    options: tuple[str, str, str, str]
    answer: str
    url: str = ""


@dataclass
class Dataset:
    """Validated questions plus where their files are."""

    root: Path
    question_file: Path
    sha256: str
    questions: list[Question]
    video_paths: dict[str, Path] = field(default_factory=dict)  # videoID -> file
    # videoIDs with no file, in question order
    missing_videos: list[str] = field(default_factory=list)

    def video_path(self, q: Question) -> Path | None:
        return self.video_paths.get(q.videoID)

    def subtitle_path(self, q: Question) -> Path | None:
        return find_subtitle(self.root, q.videoID)


def find_question_file(data_dir: Path) -> Path:
    """The question file of ``data_dir``: ``videomme/test-*.parquet``, else a single ``*.parquet``
    or ``*.json``/``*.jsonl`` in ``data_dir/videomme`` or ``data_dir`` itself."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DatasetError(
            f"{data_dir} is not a folder: pass --data the folder that holds videomme/ and data/."
        )
    found = sorted((data_dir / "videomme").glob("test-*.parquet"))
    if found:
        if len(found) > 1:
            raise DatasetError(
                f"several question files in {data_dir / 'videomme'} "
                f"({', '.join(p.name for p in found)}): "
                "pass the one to use with --questions."
            )
        return found[0]
    for folder in (data_dir / "videomme", data_dir):
        cands = sorted(p for ext in ("*.parquet", "*.json", "*.jsonl") for p in folder.glob(ext))
        if len(cands) == 1:
            return cands[0]
        if len(cands) > 1:
            raise DatasetError(
                f"several possible question files in {folder} "
                f"({', '.join(p.name for p in cands)}): "
                "pass the one to use with --questions."
            )
    raise DatasetError(
        f"no Video-MME question file under {data_dir}: expected "
        "videomme/test-00000-of-00001.parquet "
        "(as lmms-lab/Video-MME unpacks) or pass --questions FILE."
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Raw rows of a parquet, JSON or JSONL question file. JSON may be a list of question rows, or
    the
    official results shape: a list of videos, each with its ``questions`` list."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            data: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
    except DatasetError:
        raise
    except Exception as e:  # pyarrow.ArrowInvalid, JSONDecodeError, UnicodeDecodeError, OSError
        raise DatasetError(f"cannot read question file {path}: {type(e).__name__}: {e}") from None
    if isinstance(data, dict):
        data = data.get("questions", data.get("data"))
    if not isinstance(data, list):
        raise DatasetError(
            f"question file {path} must hold a list of questions (or of videos with 'questions')."
        )
    rows: list[dict[str, Any]] = []
    for item in data:
        if isinstance(item, dict) and isinstance(item.get("questions"), list):
            video = {k: v for k, v in item.items() if k != "questions"}
            rows.extend({**video, **q} for q in item["questions"])
        else:
            rows.append(item)
    return rows


def _text(row: dict[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: field {name!r} must be a non-empty string, got {value!r}.")
    return value.strip()


def _file_stem(row: dict[str, Any], name: str, where: str) -> str:
    """A field that names a file inside the data folder: no folder part, so a question file cannot
    make lvx read a video (or subtitles) from elsewhere (`"../../x"`)."""
    value = _text(row, name, where)
    if "/" in value or "\\" in value or "\0" in value or value.strip(".") == "":
        raise DatasetError(
            f"{where}: field {name!r} must name a file in the data folder, got {value!r}."
        )
    return value


def parse_question(row: Any, where: str) -> Question:
    """One validated :class:`Question` from a raw row; ``where`` names the row in error messages."""
    if not isinstance(row, dict):
        raise DatasetError(
            f"{where}: expected an object with the Video-MME fields, got {type(row).__name__}."
        )
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        raise DatasetError(
            f"{where}: missing field(s) {', '.join(missing)}; a Video-MME question needs "
            f"{', '.join(REQUIRED_FIELDS)}."
        )
    qid = _text(row, "question_id", where)
    where = f"{where} (question {qid})"
    options = row["options"]
    if hasattr(options, "tolist"):  # numpy arrays from pandas-written files
        options = options.tolist()
    if not isinstance(options, (list, tuple)) or len(options) != 4:
        raise DatasetError(
            f"{where}: 'options' must be a list of 4 strings 'A. ...' to 'D. ...', got {options!r}."
        )
    for letter, opt in zip("ABCD", options):
        body = opt.strip()[2:].strip() if isinstance(opt, str) else ""
        if not isinstance(opt, str) or not opt.strip().startswith(f"{letter}.") or not body:
            raise DatasetError(
                f"{where}: option {letter} must read '{letter}. <text>', got {opt!r}."
            )
    answer = _text(row, "answer", where)
    if answer not in ("A", "B", "C", "D"):
        raise DatasetError(f"{where}: 'answer' must be one of A, B, C, D, got {answer!r}.")
    duration = _text(row, "duration", where)
    if duration not in DURATIONS:
        raise DatasetError(
            f"{where}: 'duration' must be one of {', '.join(DURATIONS)}, got {duration!r}."
        )
    if isinstance(row["video_id"], int):  # "001" written as a number by some converters
        row = {**row, "video_id": f"{row['video_id']:03d}"}
    return Question(
        question_id=qid,
        video_id=_text(row, "video_id", where),
        videoID=_file_stem(row, "videoID", where),
        duration=duration,
        domain=_text(row, "domain", where),
        sub_category=_text(row, "sub_category", where),
        task_type=_text(row, "task_type", where),
        question=_text(row, "question", where),
        options=tuple(o.strip() for o in options),  # type: ignore[arg-type]
        answer=answer,
        url=str(row.get("url") or ""),
    )


def parse_questions(rows: Sequence[Any], source: str) -> list[Question]:
    if not rows:
        raise DatasetError(f"question file {source} holds no questions.")
    questions = [parse_question(row, f"{source} row {i}") for i, row in enumerate(rows)]
    dups = sorted(qid for qid, n in Counter(q.question_id for q in questions).items() if n > 1)
    if dups:
        raise DatasetError(f"{source}: duplicate question_id(s) {', '.join(dups[:10])}.")
    return questions


def find_video(root: Path, video_key: str) -> Path | None:
    """``data/<videoID>.mp4``, then ``.MP4``, then ``.mkv`` (as lmms-eval), also under
    ``video/``."""
    for folder in VIDEO_DIRS:
        for ext in VIDEO_EXTENSIONS:
            p = Path(root) / folder / f"{video_key}{ext}"
            if p.is_file():
                return p
    return None


def find_subtitle(root: Path, video_key: str) -> Path | None:
    for folder in SUBTITLE_DIRS:
        p = Path(root) / folder / f"{video_key}.srt"
        if p.is_file():
            return p
    return None


def load_dataset(data_dir: Path | str, question_file: Path | str | None = None) -> Dataset:
    """Read and validate the questions and locate every video; missing videos are listed, not
    fatal."""
    root = Path(data_dir)
    qfile = Path(question_file) if question_file else find_question_file(root)
    if not qfile.is_file():
        raise DatasetError(f"question file {qfile} does not exist.")
    questions = parse_questions(read_rows(qfile), str(qfile))
    ds = Dataset(root=root, question_file=qfile, sha256=file_sha256(qfile), questions=questions)
    for q in questions:
        if q.videoID in ds.video_paths or q.videoID in ds.missing_videos:
            continue
        path = find_video(root, q.videoID)
        if path is None:
            ds.missing_videos.append(q.videoID)
        else:
            ds.video_paths[q.videoID] = path
    return ds


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"i/k"`` (0-based ``i``, ``0 <= i < k``) to ``(i, k)``; None stays None."""
    if spec is None or spec == "":
        return None
    try:
        i_text, k_text = spec.split("/")
        i, k = int(i_text), int(k_text)
    except ValueError:
        raise DatasetError(f"--shard must look like i/k, e.g. 0/4, got {spec!r}.") from None
    if k < 1 or not 0 <= i < k:
        raise DatasetError(
            f"--shard {spec}: need k >= 1 and 0 <= i < k (shards are numbered 0 .. k-1)."
        )
    return i, k


def parse_durations(spec: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """``"short,medium"`` to ``("short", "medium")``; None means all."""
    if spec is None:
        return None
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [s for s in items if s not in DURATIONS]
    if bad or not items:
        raise DatasetError(
            f"--durations takes a comma list of {', '.join(DURATIONS)}, got {spec!r}."
        )
    return tuple(items)


def select_questions(
    questions: Sequence[Question],
    durations: Sequence[str] | None = None,
    limit: int | None = None,
    shard: tuple[int, int] | None = None,
) -> list[Question]:
    """The questions a run answers, deterministically: filter by duration, keep the first ``limit``
    (in file order), then keep shard ``i`` of ``k``. Shards split by *video* (the j-th distinct
    video goes to shard j mod k), so each video is loaded by one shard only; the k shards are
    disjoint and together give exactly the unsharded selection."""
    chosen = [q for q in questions if durations is None or q.duration in durations]
    if limit is not None:
        if limit < 0:
            raise DatasetError(f"--limit must be >= 0, got {limit}.")
        chosen = chosen[:limit]
    if shard is not None:
        i, k = shard
        order: dict[str, int] = {}
        for q in chosen:
            order.setdefault(q.videoID, len(order))
        chosen = [q for q in chosen if order[q.videoID] % k == i]
    return chosen
