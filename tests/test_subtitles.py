"""Subtitles for chat and serve: sidecar files and their languages, text streams inside the
container, bad files, the token budget, and the block chat places being the eval prompt's."""

from __future__ import annotations

import warnings

import pytest
from videos import add_subtitle_stream

import lvx_app.subtitles as subs
from lvx_app.eval.prompt import build_prompt
from lvx_app.subtitles import (
    SUBTITLE_HEADER,
    Cue,
    SubtitleError,
    fit_lines,
    load_srt,
    parse_ass,
    parse_cues,
    read_embedded,
    read_subtitle_file,
    resolve_subtitles,
    select_lines,
    subtitle_block,
)
from lvx_app.video.synthetic import write_srt

SRT = (
    '1\n00:00:00,500 --> 00:00:02,500\n<font color="white">hello</font> there\n\n2\n00:00:03,000 '
    "--> 00:00:05,000\nsecond\nline\n"
)
CUES = [(0.5, 2.5, "hello there"), (3.0, 5.0, "second line")]


def _texts(track) -> list[tuple[float, float, str]]:
    return [(c.start, c.end, c.text) for c in track.cues]


def test_webvtt_and_ass_markup_is_stripped():
    vtt = (
        "WEBVTT\n\nNOTE a comment\n\n00:01.000 --> 00:02.000 align:start\n<v Anna><c.yellow>Hi</c> "
        "<00:00:01.500>you</v>"
        "\n\n01:00:00.000 --> 01:00:01.000\n<i>late</i>\n"
    )
    cues, reversed_ = parse_cues(vtt)
    assert [(c.start, c.end, c.text) for c in cues] == [
        (1.0, 2.0, "Hi you"),
        (3600.0, 3601.0, "late"),
    ]
    assert reversed_ == 0
    ass = (
        "[Events]\nFormat: ...\nDialogue: "
        "0,0:00:01.50,0:00:03.00,Default,,0,0,0,,{\\i1}Hi,\\Nthere{\\i0}\n"
    )
    assert [(c.start, c.end, c.text) for c in parse_ass(ass)[0]] == [(1.5, 3.0, "Hi, there")]


def test_sidecar_language_choice(tmp_path):
    video = tmp_path / "movie.mp4"
    video.write_bytes(b"")
    (tmp_path / "movie.en.srt").write_text(SRT)
    (tmp_path / "movie.fr.vtt").write_text("WEBVTT\n\n00:00:00.500 --> 00:00:02.500\nbonjour\n")
    (tmp_path / "other.srt").write_text(SRT.replace("hello", "WRONG"))
    french = resolve_subtitles(video, "auto", "fra")
    assert (french.source, [c.text for c in french.cues]) == ("movie.fr.vtt", ["bonjour"])
    english = resolve_subtitles(video, "auto", "en")
    assert english.source == "movie.en.srt" and _texts(english) == CUES and not english.notes
    # two tagged files and no language: the first, and a note naming the other
    either = resolve_subtitles(video, "auto")
    assert (
        either.source == "movie.en.srt"
        and "movie.fr.vtt" in either.notes[0]
        and "--subtitle-lang" in either.notes[0]
    )
    (tmp_path / "movie.srt").write_text(SRT.replace("hello", "plain"))
    # the untagged sidecar comes first
    assert resolve_subtitles(video, "auto").source == "movie.srt"
    none = resolve_subtitles(video, "auto", "de")
    assert not none.cues and "no de subtitles" in none.notes[0]
    assert resolve_subtitles(video, "none").cues == []


@pytest.mark.parametrize(
    "codec,ext", [("mov_text", ".mp4"), ("subrip", ".mkv"), ("webvtt", ".mkv"), ("ass", ".mkv")]
)
def test_embedded_text_streams(short_video, tmp_path, codec, ext):
    video = add_subtitle_stream(
        short_video, tmp_path / f"movie{ext}", [(s, e, t) for s, e, t in CUES], codec
    )
    track = resolve_subtitles(video, "auto")
    name = {"subrip": "srt", "ass": "ssa"}.get(codec, codec)
    assert _texts(track) == CUES and track.source == f"stream 1 ({name}, eng) of movie{ext}"
    assert (
        resolve_subtitles(video, "auto", "en").cues
        and not resolve_subtitles(video, "auto", "ja").cues
    )
    (tmp_path / "movie.srt").write_text(SRT.replace("hello", "sidecar"))
    assert resolve_subtitles(video, "auto").source == "movie.srt", (
        "a sidecar file wins over the stream inside"
    )


def test_bitmap_subtitles_are_named_unsupported(short_video, tmp_path):
    video = add_subtitle_stream(short_video, tmp_path / "movie.mkv", CUES, "dvdsub")
    track = read_embedded(video)
    assert (
        not track.cues
        and len(track.notes) == 1
        and "bitmap subtitles" in track.notes[0]
        and "dvdsub" in track.notes[0]
    )


def test_bad_files_are_one_line(tmp_path, monkeypatch):
    video = tmp_path / "movie.mp4"
    binary = tmp_path / "x.srt"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(SubtitleError, match="binary"):
        resolve_subtitles(video, str(binary))
    with pytest.raises(SubtitleError, match="not found"):
        resolve_subtitles(video, str(tmp_path / "missing.srt"))
    empty = tmp_path / "notes.srt"
    empty.write_text("just some words\nwith no timing\n")
    with pytest.raises(SubtitleError, match="no subtitle cues"):
        resolve_subtitles(video, str(empty))
    monkeypatch.setattr(subs, "MAX_SUBTITLE_MB", 1)
    huge = tmp_path / "huge.srt"
    huge.write_text(SRT * (2 * 2**20 // len(SRT) + 1))
    with pytest.raises(SubtitleError, match="over the 1 MB"):
        resolve_subtitles(video, str(huge))
    # auto: a broken sidecar is a note, not an error
    (tmp_path / "movie.srt").write_bytes(binary.read_bytes())
    track = resolve_subtitles(video, "auto")
    assert not track.cues and "binary" in track.notes[0] and "without subtitles" in track.notes[0]
    with warnings.catch_warnings(
        record=True
    ) as caught:  # the eval: a warning, and the question goes on without
        warnings.simplefilter("always")
        assert load_srt(tmp_path / "movie.srt") == []
    assert "binary" in str(caught[0].message)


def test_encodings_detected_stated_and_refused(tmp_path):
    video = tmp_path / "movie.mp4"
    text = SRT.replace(
        "hello", "Привет, как дела? Это пример субтитров на русском языке, без юникода."
    )
    latin = tmp_path / "cyrillic.srt"
    latin.write_bytes(text.encode("cp1251"))
    track = resolve_subtitles(video, str(latin))
    assert (
        track.cues[0].text.startswith("Привет, как дела?")
        and "not UTF-8; read it as cp1251" in track.notes[0]
    )
    sjis = tmp_path / "sjis.srt"
    sjis.write_bytes(
        SRT.replace("hello", "こんにちは、元気ですか。これは日本語の字幕の例です。").encode(
            "shift_jis"
        )
    )
    assert resolve_subtitles(video, str(sjis)).cues[0].text.startswith("こんにちは、元気ですか。")
    stated = resolve_subtitles(video, str(latin), encoding="cp1251")
    assert stated.cues == track.cues and not stated.notes
    with pytest.raises(SubtitleError, match="not valid utf-8"):
        resolve_subtitles(video, str(latin), encoding="utf-8")
    with pytest.raises(SubtitleError, match="unknown encoding"):
        resolve_subtitles(video, str(latin), encoding="klingon")
    wide = tmp_path / "wide.srt"
    wide.write_bytes(text.encode("utf-16"))  # BOM + NUL bytes: not taken for binary
    assert resolve_subtitles(video, str(wide)).cues == track.cues


WESTERN = {
    "fr": "Le château\nTrès bien, merci. Où est la fenêtre ? Ça va, garçon.",
    "de": "Die Straße ist schön.\nGröße, Übung: Mädchen laufen über die Brücke.",
    "es": "¿Dónde está el niño?\nMañana vamos a la montaña. ¡Qué difícil es la canción!",
    "pt": "A informação não está disponível.\nSão Paulo é uma cidade. As lições põem-se.",
}
OTHERS = {  # Latin text of other code pages, and other scripts: as detected
    "cp1250": "Zażółć gęślą jaźń. Łódź jest dużym miastem w Polsce, pięknym i starym.",
    "cp1251": "Привет, как дела? Это пример субтитров на русском языке.",
    "cp1253": "Καλημέρα, τι κάνετε; Αυτό είναι ένα παράδειγμα υποτίτλων.",
}
LATIN = {  # Latin text of code pages detection confuses with one another: read by their letters
    ("tr", "cp1254"): "Şimdi ne yapacağız? Işık çok güzel, İstanbul'a gidiyoruz.",
    ("tr-short", "cp1254"): "Günaydın! Bugün hava çok güzel.",
    ("tr-two-letters", "cp1254"): "Ben de geliyorum, şimdi değil.",  # or Lithuanian: žimdi dešil
    ("hr", "cp1250"): "Čovjek je došao kući, đak je bio žedan.",
    ("cs", "cp1250"): "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    ("hu", "cp1250"): "Árvíztűrő tükörfúrógép, öt szép szűz lány őrült írót nyúz.",
    ("lt", "cp1257"): "Labas rytas, kaip sekasi? Ačiū, gerai. Šiandien šalta.",
    ("lv", "cp1257"): "Labrīt, kā jums klājas? Paldies, labi. Šodien ir auksts.",
}


def test_a_folder_given_as_subtitles_is_named_a_folder(tmp_path):
    with pytest.raises(SubtitleError, match=r"is a folder, not a subtitle file; name an \.srt"):
        resolve_subtitles(tmp_path / "movie.mp4", str(tmp_path))


@pytest.mark.parametrize("encoding", ["cp1252", "latin-1"])
@pytest.mark.parametrize("lang", sorted(WESTERN))
def test_western_files_are_read_as_cp1252_before_rarer_code_pages(tmp_path, lang, encoding):
    path = tmp_path / f"{lang}.srt"
    path.write_bytes(SRT.replace("hello", WESTERN[lang]).encode(encoding))
    track = resolve_subtitles(tmp_path / "movie.mp4", str(path))
    assert track.cues[0].text == " ".join(WESTERN[lang].split("\n")) + " there"
    assert track.notes == [
        f"{lang}.srt is not UTF-8; read it as cp1252 (detected); pass --subtitle-encoding to choose"
    ]


@pytest.mark.parametrize("encoding", sorted(OTHERS))
def test_other_code_pages_keep_their_detection(tmp_path, encoding):
    path = tmp_path / "other.srt"
    path.write_bytes(SRT.replace("hello", OTHERS[encoding]).encode(encoding))
    track = resolve_subtitles(tmp_path / "movie.mp4", str(path))
    assert track.cues[0].text == OTHERS[encoding] + " there"
    assert f"read it as {encoding}" in track.notes[0]


@pytest.mark.parametrize("lang, encoding", sorted(LATIN))
def test_latin_code_pages_are_chosen_by_the_letters_of_a_language(tmp_path, lang, encoding):
    """Detection alone takes Turkish for cp1250 or mac_latin2 (`Ţimdi`, `yapacađýz`); the code
    page whose reading spells one language's letters is chosen."""
    path = tmp_path / f"{lang}.srt"
    path.write_bytes(SRT.replace("hello", LATIN[lang, encoding]).encode(encoding))
    track = resolve_subtitles(tmp_path / "movie.mp4", str(path))
    assert track.cues[0].text == LATIN[lang, encoding] + " there"
    assert f"read it as {encoding}" in track.notes[0]


def test_reversed_and_overlapping_cues(tmp_path):
    path = tmp_path / "odd.srt"
    path.write_text(
        "1\n00:00:05,000 --> 00:00:01,000\nbackwards\n\n2\n00:00:00,000 --> 00:00:09,000\nlong\n\n"
        "3\n00:00:02,000 --> 00:00:03,000\nshort\n"
    )
    track = read_subtitle_file(path)
    assert "1 cue(s) end before they start" in track.notes[0]
    assert select_lines(track.cues, [1.0, 2.5, 5.0, 8.0]) == ["long", "short", "backwards"]


def test_written_srt_reads_back_to_the_millisecond(tmp_path):
    cues = [(i * 2.4, i * 2.4 + 2.2, f"line {i}") for i in range(4)] + [(3599.9996, 3725.5, "end")]
    track = read_subtitle_file(write_srt(tmp_path / "w.srt", cues))
    assert [(round(a, 3), round(b, 3), t) for a, b, t in cues] == _texts(track)


class _CountedText(str):
    """A cue's text that counts how often it is compared with another."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedText.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_selecting_a_films_lines_compares_each_line_a_bounded_number_of_times():
    # three hours with a cue every 2.4 s: deduplicating by a search of the lines kept so far would
    # compare each line with all before it (about ten million comparisons)
    n = 4500
    cues = [Cue(2.4 * i, 2.4 * i + 2.0, _CountedText(f"line {i}")) for i in range(n)]
    cues.append(Cue(2.4 * n, 2.4 * n + 2.0, _CountedText("line 7")))  # a repeated line
    _CountedText.compared = 0
    lines = select_lines(cues, [2.4 * i + 1.0 for i in range(n + 1)])
    assert lines == [f"line {i}" for i in range(n)]
    assert _CountedText.compared <= 2 * n


def test_token_budget_drops_lines_evenly():
    lines = [f"line number {i}" for i in range(40)]
    count = len  # characters stand in for tokens
    assert fit_lines(lines, 10_000, count) == lines
    kept = fit_lines(lines, 200, count)
    assert 0 < len(kept) < 40 and count(subtitle_block(kept)) <= 200
    assert kept[0] != lines[0] and kept[-1] != lines[0] and int(kept[-1].split()[-1]) > 30, (
        "spread over the video"
    )
    assert fit_lines(lines, 5, count) == []


def test_chat_block_is_the_eval_prompts(tiny_checkpoints, short_video, tmp_path):
    """The same video and .srt: chat's prefilled block is the text the eval prompt starts with."""
    from engine_configs import engine_config

    from lvx_app.runtime.open import open_engine

    srt = tmp_path / "movie.srt"
    srt.write_text(SRT)
    engine = open_engine(engine_config(tiny_checkpoints["g2"], tmp_path))
    try:
        summary = engine.load_video(
            short_video, subtitles=resolve_subtitles(short_video, str(srt)).cues
        )
        block = engine.session.video.loaded.subtitle_block
    finally:
        engine.close()
    eval_prompt = build_prompt(
        "Q?", ["A. a.", "B. b."], select_lines(load_srt(srt), summary.timestamps)
    )
    assert block == f"{SUBTITLE_HEADER}\nhello there\nsecond line" and summary.subtitle_lines == 2
    assert eval_prompt.startswith(block + "\nSelect the best answer")


def test_lvx_chat_subtitles(tiny_checkpoints, short_video, tmp_path):
    """`lvx chat --subtitles`: a bad file is one line before any model loads; a good one is said and
    placed."""
    import io

    from engine_configs import engine_config
    from rich.console import Console

    from lvx_app.cli.chat import run_chat, run_chat_command
    from lvx_app.runtime.open import open_engine

    bad = tmp_path / "bad.srt"
    bad.write_bytes(b"\x00\x01" * 100)
    out = io.StringIO()
    config = engine_config("/nonexistent/checkpoint", subtitles=str(bad))
    code = run_chat_command(short_video, config, Console(file=out, width=200))
    assert code == 2 and out.getvalue().strip().splitlines() == [
        f"error: {bad.name} is binary, not a text subtitle "
        "file; pass an .srt or .vtt file, or --subtitles none"
    ]
    good = tmp_path / "good.srt"
    good.write_text(SRT)
    engine = open_engine(engine_config(tiny_checkpoints["g2"], tmp_path, max_new_tokens=4))
    out = io.StringIO()
    try:
        code = run_chat(
            engine,
            video=short_video,
            console=Console(file=out, width=200),
            stdin=io.StringIO("what is said?\n/quit\n"),
            subtitles=resolve_subtitles(short_video, str(good)),
        )
    finally:
        engine.close()
    text = out.getvalue()
    assert (
        code == 0
        and "2 subtitle line(s) placed" in text
        and "subtitles: 2 line(s) at the sampled frames, from good.srt" in text
    )


def test_chat_under_a_users_torchrun_takes_subtitles(
    tiny_checkpoints, short_video, tmp_path, capsys, monkeypatch
):
    """`lvx chat VIDEO --subtitles FILE` as a rank of a torchrun group the user started (here a
    group of one): rank 0 runs the chat with the subtitles; a missing file is one line."""
    import io
    import sys

    from engine_configs import engine_config
    from rich.console import Console

    from lvx_app.cli.chat import run_chat_command

    good = tmp_path / "good.srt"
    good.write_text(SRT)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(sys, "stdin", io.StringIO("/quit\n"))
    config = engine_config(tiny_checkpoints["g2"], tmp_path, subtitles=str(good))
    out = io.StringIO()
    assert run_chat_command(short_video, config, Console(file=out, width=200)) == 0
    assert "subtitles: 2 line(s) at the sampled frames, from good.srt" in out.getvalue()
    missing = engine_config(tiny_checkpoints["g2"], tmp_path, subtitles=str(tmp_path / "no.srt"))
    out = io.StringIO()
    assert run_chat_command(short_video, missing, Console(file=out, width=200)) == 2
    assert "error: subtitle file not found" in out.getvalue()
