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
        if _looks_like_a_path(name):
            raise SpeechError(
                f"there is no folder {name}: --speech-model takes a faster-whisper checkpoint's "
                "folder, or a model name such as base, small or large-v3-turbo"
            )
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


FILES = ["config.json", "preprocessor_config.json", "model.bin", "tokenizer.json", "vocabulary.*"]


def _fetch(name: str) -> str:
    """The folder of `name` in the Hugging Face cache: found there without the network, else
    fetched once with the Hub's progress bars (rank 0 does it first; the others then find it)."""
    if not speech_available():
        raise SpeechError(missing_line())
    if name in _UNFETCHABLE:
        raise SpeechError(_UNFETCHABLE[name])
    from faster_whisper.utils import _MODELS, download_model

    try:
        return download_model(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached yet: fetched below
        pass
    repo = name if "/" in name else _MODELS.get(name)
    if repo is None:
        _UNFETCHABLE[name] = (
            f"there is no speech model named {name!r}: --speech-model takes one of "
            f"{', '.join(_MODELS)}, a hub id (owner/name) or a local faster-whisper folder"
        )
        raise SpeechError(_UNFETCHABLE[name])
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, allow_patterns=FILES)
    except Exception as exc:  # noqa: BLE001 - a bad name, or no network: one line either way
        _UNFETCHABLE[name] = (
            f"speech model {name!r} is not in the Hugging Face cache and could not be fetched "
            f"({_one_line(exc)}); fetch it once where the Hub can be reached, or pass a local "
            "faster-whisper folder with --speech-model, or --subtitles none"
        )
        raise SpeechError(_UNFETCHABLE[name]) from None


def _looks_like_a_path(name: str) -> bool:
    """A name with a folder in it (./x, ~/x, /x, a\\b) is a path, never a hub id (owner/name)."""
    return name.startswith((".", "~", "/")) or "\\" in name or name.count("/") > 1


def _one_line(exc: Exception, most: int = 160) -> str:
    """The exception in one line of at most `most` characters, cut at a word."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) <= most:
        return text
    return text[:most].rsplit(" ", 1)[0] + " ..."


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
