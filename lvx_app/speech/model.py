"""The Whisper checkpoint that transcribes: found (a local folder, or a name faster-whisper fetches
from the hub), named for the cache by its weights, and loaded with faster-whisper on this rank's
device. Without the `[speech]` extra every entry point here is one line saying what to install."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lvx_app.cache.features import file_identity
from lvx_app.defaults import SPEECH_MODEL_ON_CPU, SPEECH_MODEL_ON_GPU
from lvx_app.speech.audio import SpeechError
from lvx_app.speech.choice import missing_line, speech_available
from lvx_app.speech.onnx_import import import_onnxruntime_privately

WEIGHTS = "model.bin"  # a CTranslate2 checkpoint's weights (faster-whisper's published layout)


@dataclass(frozen=True)
class SpeechModel:
    """A checkpoint found on disk: its folder, the name it was asked by, and what names its weights
    in the cache."""

    path: str
    name: str  # the name asked for, or a folder's own name
    weights: str  # file_identity of model.bin


def model_name(name: str, device_type: str) -> str:
    """`--speech-model` with auto resolved for this device."""
    if name != "auto":
        return name
    return SPEECH_MODEL_ON_GPU if device_type == "cuda" else SPEECH_MODEL_ON_CPU


def find_model(name: str, device_type: str) -> SpeechModel:
    """The checkpoint `--speech-model` names: a folder holding model.bin, else a faster-whisper size
    (small, large-v3-turbo, ...) or hub id, fetched once into the Hugging Face cache. Cannot be
    found or fetched: a SpeechError line."""
    name = model_name(name, device_type)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        folder = Path(_fetch(name))
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise SpeechError(
            f"{folder} holds no {WEIGHTS}: --speech-model takes a faster-whisper (CTranslate2) "
            "checkpoint's folder, or a name such as small or large-v3-turbo"
        )
    label = folder.name if Path(name).expanduser().is_dir() else name
    return SpeechModel(str(folder.resolve()), label, file_identity(weights))


_UNFETCHABLE: dict[str, str] = {}  # name -> why: asked once per process, not at every load


def _fetch(name: str) -> str:
    if not speech_available():
        raise SpeechError(missing_line())
    if name in _UNFETCHABLE:
        raise SpeechError(_UNFETCHABLE[name])
    from faster_whisper.utils import download_model

    try:
        return download_model(name)
    except Exception as exc:  # noqa: BLE001 - a bad name, or no network: one line either way
        _UNFETCHABLE[name] = (
            f"speech model {name!r} could not be found or fetched ({_one_line(exc)}); pass a "
            "local faster-whisper folder with --speech-model, or --subtitles none"
        )
        raise SpeechError(_UNFETCHABLE[name]) from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:160]


def load_model(found: SpeechModel, device_type: str, threads: int):
    """faster-whisper's WhisperModel for `found` on this rank: float16 on a GPU (the rank's own),
    int8 on a CPU (the fastest there, by measurement)."""
    if not speech_available():
        raise SpeechError(missing_line())
    from faster_whisper import WhisperModel

    import_onnxruntime_privately()  # its detector's runtime: no file left in the temp folder
    cuda = device_type == "cuda"
    kwargs = {"device_index": _cuda_index()} if cuda else {"cpu_threads": threads}
    try:
        return WhisperModel(
            found.path,
            device="cuda" if cuda else "cpu",
            compute_type="float16" if cuda else "int8",
            **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a damaged folder or an unusable device: one line
        raise SpeechError(
            f"speech model {found.name} could not be loaded ({_one_line(exc)}); pass another "
            "--speech-model, or --subtitles none"
        ) from None


def _cuda_index() -> int:
    import torch

    return torch.cuda.current_device()
