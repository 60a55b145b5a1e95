"""A piece's audio decoded as faster-whisper's batched pipeline decodes a file: the voice activity
detector's speech gathered into chunks of at most 30 s (one Whisper window each, silence left out),
decoded in batches with beam 5 and word timestamps. The batched pipeline has no temperature
fallback, so each chunk is judged as faster-whisper's fallback judges a window: a likely silence
(no-speech probability over 0.6 with an average log-probability under -1) is dropped, a loop
(compression ratio over 2.4) or a weak decode (log-probability under -1) is decoded again by
faster-whisper's sequential path on that chunk alone, with its seeded fallback (its best try kept,
as faster-whisper keeps it); the seconds of such chunks are counted, so speech the model cannot
follow (another language through an English-only model) can be told. Chunks are made from the
piece alone, so a piece's words are the same on any number of ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lvx_app.speech.audio import SAMPLE_RATE

CHUNK_S = 30  # one Whisper window per chunk
BATCH = 8  # chunks decoded together (faster-whisper's default)
GAP_MS = 160  # the shortest pause between speech the detector splits at (the batched default)
PAD_S = 0.4  # silence laid either side of a piece: the lead the detector gives speech in a file
NO_SPEECH, LOG_PROB, COMPRESSION = 0.6, -1.0, 2.4  # faster-whisper's thresholds


@dataclass
class Decoded:
    """What a stretch of audio gave: its segments (words at times within the stretch), the
    seconds of speech in it and of those in chunks that failed the rules at temperature 0, and
    whether a chunk was decoded again at a sampling temperature."""

    segments: list = field(default_factory=list)
    speech_s: float = 0.0
    sampled: bool = False
    doubtful_s: float = 0.0


def decode(model, audio: np.ndarray, language: str | None) -> Decoded:
    """`audio`'s speech through `model` (faster-whisper's WhisperModel), chunked and batched; its
    words' times within `audio`. The audio is decoded with PAD_S of silence laid either side, as
    speech in a whole file has it before and after (a piece cut at a short pause would lack it,
    and Whisper then misses a short first word)."""
    from faster_whisper import BatchedInferencePipeline
    from faster_whisper.transcribe import restore_speech_timestamps
    from faster_whisper.vad import VadOptions, collect_chunks, get_speech_timestamps

    pad = np.zeros(int(PAD_S * SAMPLE_RATE), np.float32)
    length_s = len(audio) / SAMPLE_RATE
    audio = np.concatenate([pad, audio, pad])
    options = VadOptions(max_speech_duration_s=CHUNK_S, min_silence_duration_ms=GAP_MS)
    spans = get_speech_timestamps(audio, options)
    if not spans:
        return Decoded()
    chunks, meta = collect_chunks(audio, spans, max_duration=CHUNK_S)
    clips = [{"start": m["offset"], "end": m["offset"] + m["duration"]} for m in meta]
    pipeline = BatchedInferencePipeline(model)
    batched, _ = pipeline.transcribe(
        np.concatenate(chunks), language=language, batch_size=BATCH, word_timestamps=True,
        clip_timestamps=clips, vad_filter=False,
    )  # fmt: skip
    inside = (len(pad), len(pad) + round(length_s * SAMPLE_RATE))  # the padding is no speech
    heard = sum(max(0, min(e, inside[1]) - max(b, inside[0])) for b, e in _bounds(spans))
    got = Decoded(speech_s=heard / SAMPLE_RATE)
    per_chunk: list[list] = [[] for _ in chunks]
    for segment in batched:
        per_chunk[_chunk_of(segment.seek / model.frames_per_second, meta)].append(segment)
    kept = []
    for chunk, m, segments in zip(chunks, meta, per_chunk):
        verdict = judge(segments)
        if verdict != "keep":
            got.doubtful_s += m["duration"]
        if verdict == "again":
            segments = _one_by_one(model, chunk, m["offset"], language)
            got.sampled |= any(s.temperature > 0 for s in segments)
        if verdict != "silence":
            kept += segments
    restored = restore_speech_timestamps(kept, spans, SAMPLE_RATE)
    got.segments = [_unpadded(segment, length_s) for segment in restored]
    return got


def _bounds(spans: list[dict]) -> list[tuple[int, int]]:
    return [(span["start"], span["end"]) for span in spans]


def _unpadded(segment, length_s: float):
    """`segment` with its words' times moved back from the padded audio, within the audio."""
    for word in segment.words or ():
        word.start = min(max(0.0, word.start - PAD_S), length_s)
        word.end = min(max(word.start, word.end - PAD_S), length_s)
    return segment


def judge(segments: list) -> str:
    """One chunk's segments judged by faster-whisper's rules: "keep", "silence" or "again"."""
    if not segments:
        return "keep"
    from faster_whisper.transcribe import get_compression_ratio

    log_prob, no_speech = segments[0].avg_logprob, segments[0].no_speech_prob
    if no_speech > NO_SPEECH and log_prob < LOG_PROB:
        return "silence"
    text = "".join(s.text for s in segments)
    if get_compression_ratio(text) > COMPRESSION or log_prob < LOG_PROB:
        return "again"
    return "keep"


def _chunk_of(at: float, meta: list[dict]) -> int:
    """The chunk that starts at `at` (s, in the chunks laid end to end)."""
    return min(range(len(meta)), key=lambda i: abs(meta[i]["offset"] - at))


def _one_by_one(model, chunk: np.ndarray, offset: float, language: str | None) -> list:
    """`chunk` through faster-whisper's sequential path with its temperature fallback (seeded by
    the caller), its words moved to the chunk's place among the chunks."""
    segments, _ = model.transcribe(
        chunk, language=language, vad_filter=False, word_timestamps=True,
        condition_on_previous_text=False,
    )  # fmt: skip
    out = []
    for segment in segments:
        for word in segment.words or ():
            word.start, word.end = word.start + offset, word.end + offset
        segment.start, segment.end = segment.start + offset, segment.end + offset
        out.append(segment)
    return out
