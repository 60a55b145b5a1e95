"""One piece of audio through faster-whisper: voice-activity filtered, word timestamps, greedy at
temperature 0 and not conditioned on the piece before, so a piece's words depend on that piece
alone (the same on any number of ranks, and the same when transcribed again)."""

from __future__ import annotations

from lvx_app.speech.audio import SAMPLE_RATE, read_audio
from lvx_app.speech.onnx_import import import_onnxruntime_privately
from lvx_app.speech.pieces import MIN_GAP_S, Piece
from lvx_app.subtitles import clean_text

SILENCE = 1e-4  # -80 dBFS
CueTuple = tuple[float, float, str]  # (start s, end s, text): a cue as it travels and is cached


def transcribe_piece(
    model, path: str, piece: Piece, duration: float, language: str | None
) -> list[CueTuple]:
    """The cues of `piece`: one per Whisper segment, holding the segment's words that start inside
    the piece (those of the overlaps belong to the neighbours), at their times in the video."""
    lo, hi = piece.audio_span(duration)
    audio = read_audio(path, lo, hi)
    if silent(audio):
        return []  # an hour of silence costs its decoding alone
    segments, _ = model.transcribe(
        audio,
        language=language,
        vad_filter=True,
        word_timestamps=True,
        temperature=0.0,
        condition_on_previous_text=False,
    )
    cues = []
    for segment in segments:
        words = [w for w in segment.words or () if piece.start <= lo + w.start < piece.end]
        text = clean_text("".join(w.word for w in words))
        if text:
            start, end = float(lo + words[0].start), float(lo + words[-1].end)
            cues.append((round(start, 3), round(end, 3), text))
    return cues


def silent(audio) -> bool:
    """Whether `audio` is digital silence (no sample above -80 dBFS): no detector needed."""
    return not len(audio) or float(abs(audio).max()) < SILENCE


def speech_spans(audio) -> list[tuple[int, int]]:
    """(start, end) samples of the speech in `audio`, by faster-whisper's Silero detector."""
    if silent(audio):
        return []
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    import_onnxruntime_privately()  # no file left in the temp folder
    options = VadOptions(min_silence_duration_ms=int(MIN_GAP_S * 1000), speech_pad_ms=100)
    return [(s["start"], s["end"]) for s in get_speech_timestamps(audio, options)]


__all__ = ["SAMPLE_RATE", "CueTuple", "speech_spans", "transcribe_piece"]
