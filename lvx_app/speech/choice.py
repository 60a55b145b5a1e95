"""Whether a load transcribes speech: `--subtitles speech` always (one line to install the extra
when it is missing), `auto` when no subtitles were found and the video has an audio track (once per
process a note when the extra is missing). No torch here: the frontend decides before the ranks
run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lvx_app.speech.audio import SpeechError, audio_duration
from lvx_app.subtitles import SubtitleTrack


def install_hint() -> str:
    """The command that brings faster-whisper in, as lvx was installed: from a source checkout
    (its pyproject.toml beside the package) the editable extra from that folder, else the
    published package's extra."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "lvx_app").is_dir():
        return f'pip install -e "{checkout}[speech]"'
    return "pip install 'lvx[speech]'"


_told: set[str] = set()  # the notes this process has given (the missing extra is said once)


def speech_available() -> bool:
    """Whether faster-whisper is installed (the `[speech]` extra), without importing it."""
    return importlib.util.find_spec("faster_whisper") is not None


def missing_line() -> str:
    """The one line `--subtitles speech` gives without the extra."""
    return f"transcribing speech needs faster-whisper: {install_hint()}; or pass --subtitles none"


def wants_speech(path: str, choice: str, track: SubtitleTrack) -> bool:
    """Whether the ranks transcribe `path`'s speech for this load; a note for the user may be added
    to `track`. Raises SpeechError for `speech` without the extra."""
    choice = (choice or "auto").strip().lower()
    if choice == "speech":
        if not speech_available():
            raise SpeechError(missing_line())
        return True
    if choice != "auto" or track.cues or track.source or not audio_duration(path):
        return False
    if speech_available():
        return True
    note = f"speech not transcribed ({install_hint()} to have it when a video has no subtitles)"
    if note not in _told:
        _told.add(note)
        track.notes.append(f"no subtitles for {Path(path).name}; {note}")
    return False
