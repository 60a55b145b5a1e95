"""Small files to try every command on a CPU (`lvx demo --examples DIR`), and the ready-to-run lines
the demo prints for them.

    DIR/clip.mp4, DIR/clip.srt      a 12-second synthetic video and its subtitles (a sidecar file)
    DIR/spoken.mp4                   the clip, its subtitles spoken (where espeak-ng is installed)
    DIR/tiny-whisper/                a tiny random Whisper that transcribes it offline ([speech])
    DIR/videomme/                    a 4-question Video-MME folder in the official layout:
        videomme/test-00000-of-00001.parquet, data/<videoID>.mp4, subtitle/<videoID>.srt
    DIR/train.jsonl                  3 finetuning samples about clip.mp4
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lvx_app.speech.tracks import place, spoken, write_audio
from lvx_app.subtitles import parse_srt
from lvx_app.video.synthetic import make_video

SRT = """1
00:00:00,500 --> 00:00:03,000
A red square moves to the right.

2
00:00:04,000 --> 00:00:07,500
Now it turns blue.

3
00:00:08,000 --> 00:00:11,500
The square stops in the corner.
"""

QUESTIONS = [  # (question, options, answer, task type): the official columns' shape
    (
        "What colour is the square at first?",
        ["red", "blue", "green", "black"],
        "A",
        "Attribute Perception",
    ),
    ("What colour does it turn?", ["yellow", "blue", "white", "red"], "B", "Attribute Perception"),
    (
        "Where does the square stop?",
        ["in the middle", "at the top", "in the corner", "off"],
        "C",
        "Spatial Perception",
    ),
    ("How many squares are there?", ["three", "two", "none", "one"], "D", "Counting Problem"),
]
FONT = '<font color="white" size=".72c">{}</font>'  # how the official subtitle files wrap a line


def official_srt(srt: str) -> str:
    """`srt` as Video-MME's subtitle files are written: each cue's text in their font tag."""
    cues = []
    for cue in srt.strip().split("\n\n"):
        number, stamp, *text = cue.split("\n")
        cues.append("\n".join([number, stamp, FONT.format("\n".join(text))]))
    return "\n\n".join(cues) + "\n"


SAMPLES = [
    {"video": "clip.mp4", "question": "What moves?", "answer": "A square."},
    {"video": "clip.mp4", "question": "What colour does it turn?", "answer": "Blue."},
    {
        "video": "clip.mp4",
        "conversations": [
            {"from": "human", "value": "Where does it stop?"},
            {"from": "gpt", "value": "In the corner."},
        ],
    },
]


def write_examples(folder: Path) -> dict[str, Path]:
    """Write the example files (kept if already there); returns them by name."""
    folder.mkdir(parents=True, exist_ok=True)
    clip = folder / "clip.mp4"
    if not clip.exists():
        make_video(clip, num_frames=120, fps=10, width=160, height=96)
    (folder / "clip.srt").write_text(SRT)
    videomme = _write_videomme(folder / "videomme", clip)
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    made = {"example": clip, "subtitles": folder / "clip.srt", "videomme": videomme, "train": train}
    talking = _write_spoken(folder / "spoken.mp4", clip)
    if talking is None:
        return made
    whisper = _write_whisper(folder / "tiny-whisper")
    return made | {"spoken": talking} | ({"whisper": whisper} if whisper else {})


def _write_whisper(folder: Path) -> Path | None:
    """A tiny random Whisper in faster-whisper's layout, so the speech line needs no download;
    None without the [speech] extra (the line then says how to install it)."""
    from lvx_app.speech.choice import speech_available
    from lvx_app.speech.tiny import make_tiny_whisper

    if not speech_available():
        return None
    if not (folder / "model.bin").is_file():
        make_tiny_whisper(folder)
    return folder


def _write_spoken(path: Path, clip: Path) -> Path | None:
    """The clip with each subtitle line spoken at its time by espeak-ng; None without espeak-ng."""
    if path.exists():
        return path
    lines = [(cue.start, spoken(cue.text)) for cue in parse_srt(SRT)]
    if any(samples is None for _, samples in lines):
        return None
    return write_audio(path, place(12.0, *lines), video=clip)


def _speech_line(examples: dict[str, Path], model: str) -> str:
    """The line that transcribes the spoken clip (then `/transcript` lists what was said)."""
    from lvx_app.speech.choice import install_hint

    talking, whisper = examples.get("spoken"), examples.get("whisper")
    if talking is None:
        return "# install espeak-ng and run lvx demo --examples again for a clip that speaks"
    if whisper is None:
        return f"# {install_hint()} and run lvx demo --examples again for the speech line"
    return (
        f"lvx chat {shlex.quote(str(talking))} {model} --gpus 0 --subtitles speech "
        f"--speech-model {shlex.quote(str(whisper))}   # then /transcript: a tiny random "
        "Whisper, its words as meaningless as the tiny model's answers (--speech-model base: real)"
    )


def _write_videomme(root: Path, clip: Path) -> Path:
    """One short video, four questions, its subtitles: the official layout and values (a real
    sub-category and task types, the subtitle files' font tag), which `lvx eval videomme` and
    lmms-eval's `videomme` task read."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "subtitle").mkdir(exist_ok=True)
    video = root / "data" / "exampleClip.mp4"
    if not video.exists():
        video.write_bytes(clip.read_bytes())
    (root / "subtitle" / "exampleClip.srt").write_text(official_srt(SRT))
    rows = [
        {
            "video_id": "001",
            "duration": "short",
            "domain": "Knowledge",
            "sub_category": "Technology",  # one of the official 30: harnesses key on them
            "url": "https://example.invalid/exampleClip",
            "videoID": "exampleClip",
            "question_id": f"001-{n}",
            "task_type": task_type,
            "question": question,
            "options": [f"{letter}. {text}." for letter, text in zip("ABCD", options)],
            "answer": answer,
        }
        for n, (question, options, answer, task_type) in enumerate(QUESTIONS, start=1)
    ]
    (root / "videomme").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "videomme" / "test-00000-of-00001.parquet")
    return root


CPU_RANKS = 2  # the demo's ranks on a CPU: the lines it prints start as many


def ready_lines(
    checkpoint: Path,
    video: Path,
    examples: dict[str, Path] | None,
    *,
    finetunes: bool = True,
    others: Sequence[str] = (),
) -> list[str]:
    """A line to run for every command on the demo's files (CPU ranks, the tiny checkpoint), and
    the demo of each of the `others` model families; no finetuning line when the checkpoint's
    family cannot be finetuned (`finetunes` False), since that command would only refuse it."""
    q = shlex.quote
    model = f"--model {q(str(checkpoint))}"
    folders = [video.parent] + ([examples["example"].parent] if examples else [])
    allow = " ".join(f"--allow-paths {q(str(folder))}" for folder in folders)
    ranks = f"--gpus 0 --ranks {CPU_RANKS}"
    lines = [
        f"lvx chat {q(str(video))} {model} {ranks}",
        f"lvx serve {model} {ranks} {allow}",
        f"lvx info --model {q(str(checkpoint))}",
        "lvx cache ls",
        *(f"lvx demo --model-family {q(title)}   # the same on a tiny {title}" for title in others),
    ]
    if examples is None:
        return lines + ["lvx demo --examples DIR   # files for eval and finetune, then their lines"]
    results = examples["train"].parent / "videomme.jsonl"
    lines += [
        f"lvx chat {q(str(examples['example']))} {model} --gpus 0 --subtitles auto",
        _speech_line(examples, model),
        f"lvx eval videomme --data {q(str(examples['videomme']))} {model} --gpus 0 "
        f"--out {q(str(results))} --subtitles official",
        f"lvx eval report {q(str(results))} --scoring strict   # re-scored: unparsed is wrong",
    ]
    if finetunes:
        out = examples["train"].parent / "finetuned"
        lines.append(
            f"lvx finetune --data {q(str(examples['train']))} {model} --gpus 0 --steps 3 "
            f"--lora 4 --out {q(str(out))}"
        )
    return lines
