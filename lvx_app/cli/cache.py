"""`lvx cache ls | rm | clear`: look at and prune the cache (frame features, saved video prompts and
visual K/V).

`ls` lists each video's entries, a saved prompt or visual K/V under the features it was made from,
in as many columns as the terminal has (a pipe: $COLUMNS, else 80); every id it shows can be pasted
into `rm`, and `rm` of a features id takes what is listed under it along.
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lvx_app.cli.options import fail, new_app

cache_app = new_app(
    "cache",
    "The cache: encoded videos with their saved prompts and visual K/V, so a second chat on a "
    "video starts at once.",
)

DirOption = typer.Option(
    None,
    "--cache-dir",
    help="Cache folder. Default: $LVX_CACHE_DIR, else ~/.cache/lvx.",
    metavar="DIR",
)
# the older name of --cache-dir, still accepted
OldDirOption = typer.Option(None, "--dir", hidden=True)
_ENTRY_WIDTH = len("└ visual K/V")
_SIZE_WIDTH = len("1023.9 MB")


def _folder(cache_dir: Optional[Path], old: Optional[Path]):
    from lvx_app.cache import CacheFolder

    return CacheFolder(cache_dir or old)


def distinct_paths(paths: list[str]) -> dict[str, str]:
    """Each path's shortest tail of folders that no other path shares (`a/shapes.mp4` beside
    `b/shapes.mp4`), so rows of different videos with the same file name tell apart."""
    parts = {p: Path(p).parts for p in paths}
    shown = {}
    for path, mine in parts.items():
        for n in range(1, len(mine) + 1):
            tail = mine[-n:]
            if not any(o[-n:] == tail for q, o in parts.items() if q != path and o != mine):
                shown[path] = str(Path(*tail))
                break
        else:
            shown[path] = path
    return shown


def model_name(model: str) -> str:
    """A checkpoint as a reader knows it: its folder's name, and what a finetuning run cached."""
    from lvx_app.engine.describe import one_line

    name, _, part = model.partition("#")
    short = Path(name.rstrip("/")).name or name
    return one_line(f"{short} ({part} features, finetuning)" if part else short)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _about(e, why: str | None) -> Text:
    """What is wrong with an entry (first: it never wraps, the column is wider), then what it holds
    in words that wrap."""
    ranks = f"{e.shards}/{e.world_size} shards" if e.world_size else "? shards"
    if e.kind == "features":
        limit = f", max-frames={e.max_frames}" if e.max_frames is not None else ""
        words = (
            f"{model_name(e.model)}, {e.dtype}, {e.fps:g} fps{limit}, {e.frames} frames, {ranks}"
        )
    elif e.kind == "prompt":
        words = f"{e.tokens} tokens, {e.world_size} rank{'' if e.world_size == 1 else 's'}"
    elif e.kind == "transcript":
        words = f"speech by {e.model}, {e.tokens} line{'' if e.tokens == 1 else 's'}"
    else:
        words = f"{e.dtype}, {ranks}"
    if e.problems:
        return Text("damaged", style="red") + Text(f": {words}")
    return Text(why, style="yellow") + Text(f": {words}") if why else Text(words)


def _in_order(entries: list) -> list[tuple[object, bool]]:
    """(entry, listed under features) in the order `ls` shows one video's entries: each features
    entry followed by what was made from it, then the rest."""
    features = [e for e in entries if e.kind == "features"]
    ids = {e.entry_id for e in features}
    out = []
    for f in sorted(features, key=lambda e: e.modified):
        out.append((f, False))
        out += [(e, True) for e in entries if e.kind != "features" and e.made_from == f.entry_id]
    return out + [(e, False) for e in entries if e.kind != "features" and e.made_from not in ids]


def _video_table(rows: list, ids: dict, stale: dict, width: int) -> Table:
    """One video's entries in columns that fit `width` (the description wraps between words)."""
    stamp = "%Y-%m-%d %H:%M" if width >= 100 else "%Y-%m-%d"
    used_width = len(_dt.datetime.now().strftime(stamp))
    id_width = max(len(ids[e.entry_id]) for e, _ in rows)
    fixed = 2 + id_width + _ENTRY_WIDTH + _SIZE_WIDTH + used_width + 8  # indent, 4 gaps of 2
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1), expand=False)
    table.add_column(width=id_width, no_wrap=True)
    table.add_column(width=_ENTRY_WIDTH, no_wrap=True)
    table.add_column(width=max(16, width - fixed), overflow="fold")
    table.add_column(width=_SIZE_WIDTH, justify="right", no_wrap=True)
    table.add_column(width=used_width, no_wrap=True)
    for e, under in rows:
        table.add_row(
            ids[e.entry_id],
            ("└ " if under else "") + e.kind,
            _about(e, stale.get(id(e))),
            _human(e.bytes),
            _dt.datetime.fromtimestamp(e.modified).strftime(stamp),
        )
    return table


@cache_app.command("ls")
def ls(cache_dir: Optional[Path] = DirOption, old_dir: Optional[Path] = OldDirOption) -> None:
    """List the cache's entries.

    Per video: its features (model, settings, frames), the saved prompts and visual K/V made from
    them, their sizes and when each was last used."""
    from lvx_app.cache import short_ids
    from lvx_app.engine.describe import one_line

    folder = _folder(cache_dir, old_dir)
    entries = folder.entries()
    console = Console(highlight=False)  # the terminal's width; piped: $COLUMNS, else 80
    if not entries:
        console.print(f"The cache at {folder.root} is empty.", markup=False)
        return
    stale = {id(entries[i]): why for i, why in folder.stale(entries).items()}
    ids = short_ids([e.entry_id for e in entries])
    videos = distinct_paths(sorted({e.video for e in entries if e.video != "?"}))
    total = sum(e.bytes for e in entries)
    console.print(
        f"lvx cache in {folder.root}: {_entries(len(entries))} for {len(videos)} video(s), "
        f"{_human(total)}",
        markup=False,
    )
    for video in sorted({e.video for e in entries}, key=lambda v: videos.get(v, "~")):
        console.print()
        name = videos.get(video, "? (damaged files)")
        shown = Text(one_line(name), style="bold")  # a name's control characters, escaped
        console.print(shown + Text(f"  {one_line(video)}" if name != video else ""))
        rows = _in_order([e for e in entries if e.video == video])
        console.print(Padding(_video_table(rows, ids, stale, console.width), (0, 0, 0, 2)))
    console.print()
    stale_count = f" ({_entries(len(stale))})" if stale else ""
    console.print(
        "Remove with `lvx cache rm ID|VIDEO` (a features id takes what is listed under it along), "
        f"`lvx cache rm --stale`{stale_count} or `lvx cache clear`.",
        markup=False,
    )


def _fail_on(console: Console, removed) -> None:
    """What could not be deleted, in one line, and exit code 1."""
    if removed.failure is not None:
        console.print(Text("error: ", style="red") + Text(str(removed.failure)), soft_wrap=True)
        raise typer.Exit(1)


def _kinds(entries: list) -> str:
    kinds = [e.kind for e in entries]
    return ", ".join(dict.fromkeys(kinds))


@cache_app.command("rm")
def rm(
    targets: List[str] = typer.Argument(
        None,
        help="Entry ids as `lvx cache ls` shows them (4+ characters) or video paths.",
        metavar="ID|VIDEO...",
    ),
    stale: bool = typer.Option(
        False,
        "--stale",
        help="Remove what can never be used again: entries whose video is missing or changed, of "
        "an older format, or whose features are gone.",
    ),
    cache_dir: Optional[Path] = DirOption,
    old_dir: Optional[Path] = OldDirOption,
) -> None:
    """Remove some entries.

    A features id removes the saved prompts and visual K/V made from it too; a video path removes
    everything made from that video."""
    folder = _folder(cache_dir, old_dir)
    console = Console(highlight=False)
    if stale:
        removed = folder.remove_stale()
        n = len(removed.entries)
        console.print(f"Removed {n} stale entr{'y' if n == 1 else 'ies'}.")
        _fail_on(console, removed)
    elif not targets:
        raise fail("name what to remove: entry ids or video paths (see `lvx cache ls`), or --stale")
    try:  # an ambiguous id removes nothing, also of the other targets
        folder.refuse_ambiguous(targets or [])
    except ValueError as exc:
        raise fail(str(exc)) from None
    missing = []
    for target in targets or []:
        removed = folder.remove(target)
        if removed.entries:
            what = f"Removed {_entries(len(removed.entries))} for {target}"
            console.print(f"{what} ({_kinds(removed.entries)}).", markup=False)
        _fail_on(console, removed)
        if not removed.entries:
            missing.append(target)
    if missing:
        raise fail(f"nothing cached matches {', '.join(missing)}; see `lvx cache ls` for the ids.")


def _confirm(question: str) -> bool:
    """typer's yes/no question; a piped answer is not echoed, so its line is ended here. No
    answer at all (no terminal, an empty pipe) is one line saying to pass --yes."""
    try:
        answer = typer.confirm(question)
    except typer.Abort:  # end of input (or Ctrl-C, which a terminal's user means as such)
        if sys.stdin.isatty():
            raise
        typer.echo()
        raise fail("no answer to the question (no terminal to ask in): pass --yes") from None
    if not sys.stdin.isatty():
        typer.echo()
    return answer


@cache_app.command("clear")
def clear(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    cache_dir: Optional[Path] = DirOption,
    old_dir: Optional[Path] = OldDirOption,
) -> None:
    """Remove every entry.

    Every cached video, saved prompt and saved visual K/V."""
    folder = _folder(cache_dir, old_dir)
    console = Console(highlight=False)
    entries = folder.entries()
    size = sum(e.bytes for e in entries)
    if not entries:
        console.print(f"The cache at {folder.root} is empty: nothing to remove.", markup=False)
        return
    if not yes and not _confirm(
        f"Delete all cached features, saved prompts and visual K/V in {folder.root} "
        f"({_human(size)})?"
    ):
        console.print("Nothing removed.")
        raise typer.Exit(1)
    removed = folder.clear()
    freed = "" if removed.failure else f" ({_human(size)})"
    n = len(removed.entries)
    console.print(f"Removed {n} entries{freed} from {folder.root}.", markup=False)
    _fail_on(console, removed)
    left = folder.leftovers()
    if left:
        console.print(
            f"Left {len(left)} file(s) lvx did not write, such as {left[0]}.",
            soft_wrap=True,
            markup=False,
        )
