"""Subtitles for a video: find them, read them whatever their encoding, and pick the lines the model
sees.

One implementation for `lvx eval videomme --subtitles`, `lvx chat --subtitles` and `lvx serve`, so
all three put the same block of text, under the same header, next to the same video. The rule is
Video-MME's official one: only the lines that cover the timestamps of the sampled frames (one frame,
at most one line), in time order, deduplicated.

Sources: a sidecar file next to the video (``movie.srt``, ``movie.vtt``, ``movie.en.srt``...), a
text subtitle stream inside the container (mov_text, subrip, webvtt, ass/ssa, demuxed with PyAV), or
a file named by the user. Cue text loses its markup (``<font>``, ``<i>``, WebVTT classes and
timestamps, ASS ``{\\...}`` overrides). Bad files (binary, 100 MB, no cues, an unknown encoding) are
one :class:`SubtitleError` line; what can be worked around (an encoding guessed, cues that end
before they start) is a note the frontend shows as a warning.
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lvx_app.regular_files import by_descriptor, open_regular, read_regular

SUBTITLE_HEADER = "This video's subtitles are listed below:"
SIDECAR_EXTENSIONS = (".srt", ".vtt", ".ass", ".ssa")
MAX_SUBTITLE_MB = 16  # a feature film's subtitles are well under 1 MB

_TIMING = re.compile(
    r"(?:(\d+):)?(\d{1,2}):(\d{1,2})[,.](\d{1,3})\s*-->\s*(?:(\d+):)?(\d{1,2}):(\d{1,2})[,.](\d{1,3})"
)
_TAGS = re.compile(
    r"</?(?:font|i|b|u|c|v|ruby|rt|lang|span)\b[^>]*>|<\d+:\d{2}(?::\d{2})?[.,]\d{1,3}>",
    re.IGNORECASE,
)
_ASS_OVERRIDE = re.compile(r"\{\\[^}]*\}")
_ASS_BREAK = re.compile(r"\\[Nnh]")
_ASS_TIME = re.compile(r"(\d+):(\d{2}):(\d{2})[.:](\d{1,3})")
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)  # fmt: skip
# ISO 639-1 code -> its ISO 639-2 codes and English name, for --subtitle-lang and `movie.eng.srt`
# style tags.
_LANGUAGES = {
    "en": "eng english", "fr": "fra fre french", "de": "deu ger german", "es": "spa spanish",
    "it": "ita italian", "pt": "por portuguese", "nl": "nld dut dutch", "ru": "rus russian",
    "zh": "zho chi chinese", "ja": "jpn japanese", "ko": "kor korean", "ar": "ara arabic",
    "hi": "hin hindi", "tr": "tur turkish", "pl": "pol polish", "sv": "swe swedish",
    "da": "dan danish", "no": "nor norwegian", "fi": "fin finnish", "cs": "ces cze czech",
    "el": "ell gre greek", "he": "heb hebrew", "uk": "ukr ukrainian", "vi": "vie vietnamese",
    "th": "tha thai",
}  # fmt: skip


# Code pages of Latin script charset detection may name for a subtitle file; for those, Western
# European text is read as cp1252 first (`western_text`)
LATIN_CODE_PAGES = frozenset(
    "cp1250 cp1252 cp1254 cp1257 cp1258 latin_1 iso8859_2 iso8859_3 iso8859_4 iso8859_9 "
    "iso8859_10 iso8859_13 iso8859_14 iso8859_15 iso8859_16 mac_roman mac_latin2 mac_iceland "
    "mac_turkish hp_roman8 cp437 cp850 cp852 cp857 cp858 cp860 cp861 cp863 cp865 cp775".split()
)
_PUNCTUATION = frozenset("«»‹›“”„‘’‚–—…°·•×©®™§\u00a0\u00ad")


def _letters(letters: str) -> frozenset[str]:
    return frozenset(letters + letters.upper())


@dataclass(frozen=True)
class _Alphabet:
    """The letters beyond ASCII of a language written in a Latin code page: those its words use
    often, and those only a few words use."""

    code_page: str
    common: frozenset[str]
    rare: frozenset[str] = frozenset()


# Western European languages are cp1252's (`_WESTERN`); a tie goes to the language listed first
_ALPHABETS = (
    _Alphabet("cp1250", _letters("ąćęłńóśźż")),  # Polish
    _Alphabet("cp1250", _letters("áčéěířšýžů"), _letters("ďňťúó")),  # Czech
    _Alphabet("cp1250", _letters("áäčďéíľňóôšťúýž"), _letters("ĺŕ")),  # Slovak
    _Alphabet("cp1250", _letters("áéíóöőúüű")),  # Hungarian
    _Alphabet("cp1250", _letters("ăâîşţ")),  # Romanian
    _Alphabet("cp1250", _letters("čćđšž")),  # Croatian, Bosnian, Slovenian
    _Alphabet("cp1254", _letters("çğıöşü") | {"İ"}, _letters("âîû")),  # Turkish
    _Alphabet("cp1257", _letters("ąčęėįšųūž")),  # Lithuanian
    _Alphabet("cp1257", _letters("āčēģīķļņšūž")),  # Latvian
    _Alphabet("cp1257", _letters("äõöü"), _letters("šž")),  # Estonian
)
_WESTERN = frozenset(
    "àâäáãåæçèéêëìíîïñòóôõöøœùúûüÿßÀÂÄÁÃÅÆÇÈÉÊËÌÍÎÏÑÒÓÔÕÖØŒÙÚÛÜŸ"
    "«»‹›“”„‘’‚–—…°ºª¿¡€·•×£©®™§\u00a0\u00ad"
)


class SubtitleError(ValueError):
    """A subtitle file or option that cannot be used; the message is one line that says what to
    do."""


WordTime = tuple[float, float, str]  # (start s, end s, the word as said): a word of a transcript


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str  # markup stripped, inner line breaks joined with spaces
    # each word's times, where the speech model placed them (a transcript's cues; () for a file's)
    words: tuple[WordTime, ...] = ()


@dataclass
class SubtitleTrack:
    """The cues chosen for a video, where they came from, and what the user should be told about
    them."""

    cues: list[Cue] = field(default_factory=list)
    source: str = ""  # "movie.en.srt", "stream 2 (mov_text, eng) of movie.mp4"; "" = no subtitles
    notes: list[str] = field(default_factory=list)
    speech: bool = False  # none found: the ranks transcribe the speech (lvx_app/speech)


# ---- text
# --------------------------------------------------------------------------------------------------
def clean_text(text: str) -> str:
    """One line of plain text: HTML-like tags, WebVTT timestamps and ASS overrides removed,
    whitespace collapsed."""
    text = _ASS_BREAK.sub(" ", _ASS_OVERRIDE.sub("", _TAGS.sub("", text.replace("\u2060", ""))))
    return " ".join(text.replace("\\{", "{").replace("\\\\", "\\").split())


def _seconds(h: str | None, m: str, s: str, frac: str) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + int(s) + int(frac.ljust(3, "0")) / 1000


def parse_cues(text: str) -> tuple[list[Cue], int]:
    """(cues in start order, how many ended before they started) of SRT or WebVTT text. Blocks
    without a timing line or without text are skipped; a reversed cue is kept as an instant at its
    start."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    cues: list[Cue] = []
    reversed_ = 0
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        for i, line in enumerate(lines):
            m = _TIMING.search(line)
            if m:
                body = clean_text(" ".join(lines[i + 1 :]))
                if body:
                    start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
                    reversed_ += end < start
                    cues.append(Cue(start, max(start, end), body))
                break
    cues.sort(key=lambda c: (c.start, c.end))
    return cues, reversed_


def parse_srt(text: str) -> list[Cue]:
    """Cues of SRT (or WebVTT) text, in start order."""
    return parse_cues(text)[0]


def parse_ass(text: str) -> tuple[list[Cue], int]:
    """(cues, reversed count) of an ASS/SSA script: its ``Dialogue:`` lines (text is the tenth
    field)."""
    cues: list[Cue] = []
    reversed_ = 0
    for line in text.splitlines():
        if not line.startswith("Dialogue:"):
            continue
        fields = line[len("Dialogue:") :].split(",", 9)
        times = [_ASS_TIME.fullmatch(f.strip()) for f in fields[1:3]] if len(fields) == 10 else []
        body = clean_text(fields[9]) if len(fields) == 10 else ""
        if body and all(times):
            start, end = (_seconds(*t.groups()) for t in times)  # type: ignore[union-attr]
            reversed_ += end < start
            cues.append(Cue(start, max(start, end), body))
    cues.sort(key=lambda c: (c.start, c.end))
    return cues, reversed_


def decode_bytes(data: bytes, name: str, encoding: str | None = None) -> tuple[str, str | None]:
    """(text, note): ``encoding`` if given; else a BOM, strict UTF-8, or charset detection (with a
    note)."""
    if encoding:
        try:
            return data.decode(encoding), None
        except LookupError:
            raise SubtitleError(
                f"unknown encoding {encoding!r} (--subtitle-encoding); e.g. utf-8, cp1252, "
                "gb18030, shift_jis"
            ) from None
        except UnicodeDecodeError:
            raise SubtitleError(
                f"{name} is not valid {encoding} text; name another --subtitle-encoding, or leave "
                "it out to detect one"
            ) from None
    for bom, codec in _BOMS:
        if data.startswith(bom):
            return data.decode(codec, errors="replace"), None
    if b"\x00" in data[:65536]:
        raise SubtitleError(
            f"{name} is binary, not a text subtitle file; pass an .srt or .vtt file, or "
            "--subtitles none"
        )
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    from charset_normalizer import from_bytes  # only for the rare non-UTF-8 file

    best = from_bytes(data).best()
    if best is None:
        raise SubtitleError(
            f"{name} is not text in any encoding found; pass --subtitle-encoding, or --subtitles "
            "none"
        )
    text, encoding = str(best), best.encoding
    if encoding in LATIN_CODE_PAGES:
        text, encoding = latin_text(data) or (text, encoding)
    return (
        text,
        f"{name} is not UTF-8; read it as {encoding} (detected); pass --subtitle-encoding to "
        "choose",
    )


def latin_text(data: bytes) -> tuple[str, str] | None:
    """(text, code page) of `data` in Latin script: Western European text as cp1252 (see
    `western_text`), else the code page whose reading spells one language's letters, its common
    ones most often. The Latin code pages share most bytes and differ in a few letters; detection
    of a short file often names the wrong one (Turkish in cp1254 as cp1250 or mac_latin2: `Ţimdi`,
    `yapacađýz`), whose reading mixes letters of several languages. None: no language fits."""
    western = western_text(data)
    if western is not None:
        return western, "cp1252"
    best, best_score = None, 0
    for alphabet in _ALPHABETS:
        text = data.decode(alphabet.code_page, errors="replace")
        found = {c for c in text if ord(c) > 127} - _PUNCTUATION
        if found <= alphabet.common | alphabet.rare:
            score = sum(text.count(c) for c in found & alphabet.common)
            if score > best_score:
                best, best_score = (text, alphabet.code_page), score
    return best


def western_text(data: bytes) -> str | None:
    """`data` as cp1252 (Latin-1's superset) when it reads as Western European text: every
    character beyond ASCII is a letter or mark of French, German, Spanish, Portuguese, Italian,
    Dutch, the Nordic languages or Catalan. Detection alone often picks a rarer Latin code page that
    differs only in a few letters (cp1257: château -> chāteau, très -> trčs); those letters then
    read as something no Western text holds (Polish ł as ³, Turkish ş as þ)."""
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:
        return None
    found = {c for c in text if ord(c) > 127}
    if not found <= _WESTERN or {"õ", "û"} <= found:  # both: Hungarian's ő and ű in cp1250
        return None
    return text


def read_subtitle_file(path: Path | str, encoding: str | None = None) -> SubtitleTrack:
    """The cues of an .srt / .vtt / .ass file; SubtitleError if it cannot be read (a file with no
    cues is no error
    here: callers decide)."""
    path = Path(path)
    if path.is_dir():
        raise SubtitleError(
            f"{path} is a folder, not a subtitle file; name an .srt, .vtt or .ass file in it, or "
            "--subtitles auto to find the one next to the video"
        )
    if path.exists() and not path.is_file():  # never opened: a FIFO would block the reader
        raise SubtitleError(
            f"{path} is not a regular file (a pipe, socket or device); name an .srt, .vtt or .ass "
            "file, or --subtitles none"
        )
    if not path.is_file():
        raise SubtitleError(f"subtitle file not found: {path}")
    size_mb = path.stat().st_size / 2**20
    if size_mb > MAX_SUBTITLE_MB:
        raise SubtitleError(
            f"{path.name} is {size_mb:.0f} MB, over the {MAX_SUBTITLE_MB} MB a subtitle file may "
            "be; pass the right file, or --subtitles none"
        )
    try:  # the file checked above may have been swapped for a FIFO since: never blocks
        data = read_regular(path, int(MAX_SUBTITLE_MB * 2**20))
    except (OSError, ValueError) as exc:
        raise SubtitleError(f"{exc}; pass the right file, or --subtitles none") from None
    text, note = decode_bytes(data, path.name, encoding)
    parse = parse_ass if path.suffix.lower() in (".ass", ".ssa") else parse_cues
    cues, reversed_ = parse(text)
    notes = [note] if note else []
    if reversed_:
        notes.append(
            f"{path.name}: {reversed_} cue(s) end before they start; each is kept at its start time"
        )
    return SubtitleTrack(cues, path.name, notes)


def load_srt(path: Path | str | None) -> list[Cue]:
    """Cues of a Video-MME ``.srt`` file; a missing file (None) means no subtitles, and so does an
    unreadable one (with a warning), so one bad file does not stop a whole evaluation."""
    if path is None:
        return []
    try:
        return read_subtitle_file(path).cues
    except SubtitleError as exc:
        import warnings

        warnings.warn(f"{exc}; answered without subtitles", stacklevel=2)
        return []


# ---- the lines the model sees
# --------------------------------------------------------------------------------------------------
def select_lines(cues: Sequence[Cue], timestamps: Sequence[float]) -> list[str]:
    """The subtitle lines at the sampled frame ``timestamps`` (seconds), in time order,
    deduplicated.

    Each timestamp takes the cue that covers it (``start <= t <= end``); where rolling cues overlap,
    the one that started last (the line on screen most recently). A timestamp in a gap takes
    nothing, so there are never more lines than frames.
    """
    starts = [c.start for c in cues]
    reach = list(itertools.accumulate((c.end for c in cues), max))  # latest end among cues[: i + 1]
    picked: set[int] = set()
    for t in timestamps:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and reach[i] >= t and cues[i].end < t:
            i -= 1  # an earlier, longer cue still covers t
        if i >= 0 and cues[i].end >= t:
            picked.add(i)
    # each text in the place of its first cue; searching the lines kept so far instead would be
    # quadratic in a film's thousands of lines
    return list(dict.fromkeys(cues[i].text for i in sorted(picked)))


def subtitle_block(lines: Sequence[str]) -> str:
    """The header and the lines, one per line: the text the eval prompt starts with and chat puts
    after the video."""
    return "\n".join([SUBTITLE_HEADER, *lines]) if lines else ""


def timed_block(cues: Sequence[Cue], timestamps: Sequence[float]) -> str:
    """Every cue, each after the time it starts, and the sampled frames' times beside them: the
    whole of what the video says within the model's reach, placed against its frames."""
    from lvx_app.video.plan import format_timestamp  # (it brings torch: not at the CLI's start)

    if not cues:
        return ""
    frames = _frame_times(timestamps, format_timestamp)
    header = f"{SUBTITLE_HEADER} (each line after the time it is said; {frames})"
    return "\n".join([header, *(f"[{format_timestamp(c.start)}] {c.text}" for c in cues)])


def _frame_times(timestamps: Sequence[float], format_timestamp: Callable[[float], str]) -> str:
    if not timestamps:
        return "no frames"
    if len(timestamps) <= 16:
        return "the frames are at " + ", ".join(format_timestamp(t) for t in timestamps)
    step = (timestamps[-1] - timestamps[0]) / (len(timestamps) - 1)
    return (
        f"the {len(timestamps)} frames run from {format_timestamp(timestamps[0])} to "
        f"{format_timestamp(timestamps[-1])}, one every {step:.3g} s"
    )


def _stamp(t: float, comma: bool = True) -> str:
    """SRT's `00:01:02,345` (WebVTT's `00:01:02.345` without `comma`), to the millisecond."""
    s, ms = divmod(round(t * 1000), 1000)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}{',' if comma else '.'}{ms:03d}"


def write_srt(path: str | os.PathLike, cues: Sequence) -> Path:
    """An .srt file holding `cues` (Cue, or (start s, end s, text)), to the millisecond. SRT has
    no place for word times: `write_vtt` keeps them."""
    rows = [(c.start, c.end, c.text) if isinstance(c, Cue) else c for c in cues]
    blocks = (
        f"{i}\n{_stamp(a)} --> {_stamp(b)}\n{text}\n" for i, (a, b, text) in enumerate(rows, 1)
    )
    path = Path(path)
    path.write_text("\n".join(blocks), encoding="utf-8")
    return path


def write_vtt(path: str | os.PathLike, cues: Sequence[Cue]) -> Path:
    """A WebVTT file holding `cues`, each word after the first at its start as a cue timestamp
    (`The <00:00:02.420>bridge`: the karaoke timing players highlight word by word, and any
    WebVTT reader, ours too, takes as plain text). A cue without word times is its text alone."""
    blocks = ["WEBVTT\n"]
    for cue in cues:
        blocks.append(f"{_stamp(cue.start, False)} --> {_stamp(cue.end, False)}\n{_timed(cue)}\n")
    path = Path(path)
    path.write_text("\n".join(blocks), encoding="utf-8")
    return path


def _timed(cue: Cue) -> str:
    """The cue's text with a timestamp before each word but the first (kept within the cue, as
    WebVTT asks); its plain text when it holds no word times."""
    if not cue.words:
        return cue.text
    said = [cue.words[0][2].strip()]
    for start, _, word in cue.words[1:]:
        at = min(max(start, cue.start), cue.end)
        said.append(f"<{_stamp(at, False)}>{word.strip()}")
    return " ".join(said)


def fit_lines(lines: Sequence[str], budget: int, count_tokens: Callable[[str], int]) -> list[str]:
    """The most lines, spread evenly over the video, whose block is at most ``budget`` tokens (all
    if they fit)."""
    lines = list(lines)

    def spread(k: int) -> list[str]:
        return [lines[int((i + 0.5) * len(lines) / k)] for i in range(k)] if k else []

    if not lines or count_tokens(subtitle_block(lines)) <= budget:
        return lines
    lo, hi = 0, len(lines) - 1  # lo fits (the empty block), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count_tokens(subtitle_block(spread(mid))) <= budget else (lo, mid - 1)
    return spread(lo)


# ---- where they come from
# --------------------------------------------------------------------------------------------------
def _aliases(lang: str) -> set[str]:
    """Every spelling of a language code: ``en`` -> {en, eng, english}; ``eng`` -> the same."""
    lang = lang.lower().replace("_", "-").split("-")[0]
    for code, names in _LANGUAGES.items():
        if lang == code or lang in names.split():
            return {code, *names.split()}
    return {lang}


def language_matches(tag: str, lang: str) -> bool:
    """Whether a file tag (``en``, ``en-US``, ``eng.forced``) or a stream's language is ``lang``."""
    wanted = _aliases(lang)
    return any(_aliases(part) & wanted for part in tag.lower().split(".") if part)


def find_sidecars(video: Path | str) -> list[tuple[Path, str]]:
    """(file, language tag) of the subtitle files next to ``video`` with its stem; the untagged one
    first."""
    video = Path(video)
    found = []
    for p in video.parent.iterdir() if video.parent.is_dir() else ():
        if (
            p.suffix.lower() in SIDECAR_EXTENSIONS
            and p.is_file()
            and p.name.startswith(video.stem + ".")
        ):
            found.append((p, p.name[len(video.stem) + 1 : -len(p.suffix)]))
    return sorted(found, key=lambda f: (f[1] != "", f[0].name))


def _stream_label(stream, video: Path) -> str:
    lang = stream.language or stream.metadata.get("language") or "no language"
    return f"stream {stream.index} ({stream.codec_context.name}, {lang}) of {video.name}"


def read_embedded(video: Path | str, lang: str | None = None) -> SubtitleTrack:
    """The cues of the first text subtitle stream inside ``video`` (in ``lang`` if given), demuxed
    with PyAV.
    No such stream: an empty track, with a note when only bitmap subtitles (PGS, DVD) are there."""
    # PyAV: only when a video is opened for its subtitles (`lvx eval merge/report` never need it)
    import av

    video = Path(video)
    try:  # never a FIFO or a device: opening one would block
        fd = open_regular(video)
    except OSError:
        return SubtitleTrack()  # not a regular file: the video loader says so in its own words
    try:
        return _embedded_cues(av, by_descriptor(fd, video), video, lang)
    finally:
        os.close(fd)


def _embedded_cues(av, name: str, video: Path, lang: str | None) -> SubtitleTrack:
    """`read_embedded` on the file `name` opens (`video`: what the notes call it)."""
    try:
        container = av.open(name)
    except (av.error.FFmpegError, OSError):
        return SubtitleTrack()  # not a media file: the video loader says so in its own words
    with container:
        streams = [
            s
            for s in container.streams.subtitles
            if not lang or language_matches(s.language or "", lang)
        ]
        text = [s for s in streams if s.codec_context.codec.text_sub]
        if not text:
            bitmap = ", ".join(_stream_label(s, video) for s in streams)
            note = (
                f"{bitmap}: bitmap subtitles cannot be read as text; pass an .srt file with "
                "--subtitles FILE"
            )
            return SubtitleTrack(notes=[note] if streams else [])
        stream = text[0]
        # while the container is open: a closed stream's fields are garbage
        label = _stream_label(stream, video)
        cues = []
        try:
            for packet in container.demux(stream):
                if packet.pts is None:
                    continue
                start = float(packet.pts * stream.time_base)
                end = start + float((packet.duration or 0) * stream.time_base)
                for sub in packet.decode():
                    body = clean_text(
                        bytes(getattr(sub, "dialogue", b"") or b"").decode(
                            "utf-8", errors="replace"
                        )
                    )
                    if body:
                        cues.append(Cue(start, end, body))
        except av.error.FFmpegError as exc:
            raise SubtitleError(
                f"{label} could not be read ({exc}); pass --subtitles FILE or --subtitles none"
            ) from None
    cues.sort(key=lambda c: (c.start, c.end))
    return SubtitleTrack(cues, label)


def _auto(video: Path, lang: str | None, encoding: str | None) -> SubtitleTrack:
    """A sidecar file first (in ``lang`` if given), else a text stream inside the container."""
    sidecars = [
        (p, tag) for p, tag in find_sidecars(video) if not lang or language_matches(tag, lang)
    ]
    if sidecars:
        path, tag = sidecars[0]
        others = [p.name for p, _ in sidecars[1:]]
        try:
            track = read_subtitle_file(path, encoding)
        except SubtitleError as exc:
            return SubtitleTrack(notes=[f"{exc}; going on without subtitles"])
        if tag and len(sidecars) > 1 and not lang:
            track.notes.append(
                f"subtitles from {path.name}; also there: {', '.join(others)} (choose with "
                "--subtitle-lang)"
            )
        return track
    track = read_embedded(video, lang)
    if not track.cues and lang and not track.notes:
        track.notes.append(
            f"no {lang} subtitles next to {video.name} or inside it; going on without subtitles"
        )
    return track


def resolve_subtitles(
    video: Path | str, choice: str = "auto", lang: str | None = None, encoding: str | None = None
) -> SubtitleTrack:
    """The subtitles ``--subtitles auto|speech|none|FILE`` asks for (speech: none here, the ranks
    transcribe it). A FILE that cannot be used is a
    SubtitleError; with ``auto`` a bad sidecar is a note and the chat goes on without subtitles."""
    choice = (choice or "auto").strip()
    if choice.lower() in ("none", "speech"):  # speech: transcribed on the ranks (lvx_app/speech)
        return SubtitleTrack()
    if choice.lower() == "auto":
        return _auto(Path(video), lang, encoding)
    track = read_subtitle_file(choice, encoding)
    if not track.cues:
        raise SubtitleError(
            f"{track.source} has no subtitle cues (SRT/WebVTT '00:00:01,000 --> 00:00:02,000' "
            "lines, or ASS 'Dialogue:' lines); pass another file or --subtitles none"
        )
    return track
