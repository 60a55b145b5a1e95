"""`lvx cache ls | rm | clear`: look at and prune the visual-feature cache."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lvx_app.cli.options import new_app

cache_app = new_app(
    "cache",
    "The visual-feature cache (encoded videos and their prefilled prompts, so a second chat on a "
    "video starts at once).",
)

DirOption = typer.Option(
    None,
    "--cache-dir",
    help="Cache folder. Default: $LVX_CACHE_DIR, else ~/.cache/lvx.",
    metavar="DIR",
)
# the older name of --cache-dir, still accepted
OldDirOption = typer.Option(None, "--dir", hidden=True)


def _folder(cache_dir: Optional[Path], old: Optional[Path]) -> Optional[Path]:
    return cache_dir or old


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
    name, _, part = model.partition("#")
    short = Path(name.rstrip("/")).name or name
    return f"{short} ({part} features, finetuning)" if part else short


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _attempt(removals: list, root: Path) -> tuple[int, str | None]:
    """Run each removal (returning the ids or the number removed): (entries removed, the line for
    those that could not be, or None). A failure still counts the entries it removed."""
    from lvx_app.video.cache_files import CacheRemovalError, removal_failed

    n, failed, why = 0, 0, ""
    for remove in removals:
        try:
            done = remove()
            n += done if isinstance(done, int) else len(done)
        except CacheRemovalError as exc:
            n, failed, why = n + len(exc.removed), failed + exc.failed, why or exc.why
    return n, removal_failed(failed, why, root) if failed else None


def _fail_on(console: Console, failure: str | None) -> None:
    """What could not be deleted, in one line, and exit code 1."""
    if failure is not None:
        console.print(f"[red]error:[/red] {escape(failure)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _cache(dir: Optional[Path]):
    from lvx_app.video.feature_cache import FeatureCache

    return FeatureCache(dir)


def _saved(dir: Optional[Path]) -> dict:
    """The stores next to the features, by the title `lvx cache ls` gives them: saved prompts, saved
    visual K/V."""
    from lvx_app.engine.prefix_cache import PrefixCache
    from lvx_app.engine.visual_kv_cache import VisualKVCache

    return {"saved video prompts": PrefixCache(dir), "saved visual K/V": VisualKVCache(dir)}


def _saved_tables(console: Console, dir: Optional[Path]) -> int:
    """Print the saved video prompts and visual K/V; return their total size."""
    total = 0
    for title, store in _saved(dir).items():
        entries = store.entries()
        if not entries:
            continue
        table = Table(title=title)
        for col in (
            "id",
            "video",
            "ranks",
            *(("tokens",) if store.has_tokens else ()),
            "size",
            "status",
        ):
            table.add_column(col, justify="right" if col in ("tokens", "size") else "left")
        videos = distinct_paths([e.video for e in entries if e.video != "?"])
        for e in entries:
            tokens = [str(e.tokens)] if store.has_tokens else []
            table.add_row(
                e.entry_id[:12],
                videos.get(e.video, "?"),
                "/".join(map(str, e.world_sizes)) or "?",
                *tokens,
                _human(e.bytes),
                "[red]damaged[/red]" if e.problems else "ok",
            )
        console.print(table)
        total += sum(e.bytes for e in entries)
    return total


@cache_app.command("ls")
def ls(cache_dir: Optional[Path] = DirOption, old_dir: Optional[Path] = OldDirOption) -> None:
    """List the cache's entries.

    Cached videos (settings, shards present, frames, size), saved video prompts and visual K/V."""
    dir = _folder(cache_dir, old_dir)
    cache = _cache(dir)
    entries = cache.entries()
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table to 80 columns
        console = Console(width=200)
    if not entries and not any(store.entries() for store in _saved(dir).values()):
        console.print(f"The cache at {cache.root} is empty.", markup=False)
        return
    table = Table(title=f"lvx cache: {cache.root}")
    for col in (
        "id",
        "video",
        "fps",
        "max",
        "model",
        "dtype",
        "shards",
        "frames",
        "size",
        "last used",
        "status",
    ):
        table.add_column(
            col, justify="right" if col in ("fps", "max", "shards", "frames", "size") else "left"
        )
    total = 0
    videos = distinct_paths([e.video for e in entries if e.video != "?"])
    for e in entries:
        total += e.bytes
        shards = f"{e.shards}/{e.world_size}" if e.world_size else "0/?"
        if e.problems:
            shards += " [red](damaged)[/red]"
        table.add_row(
            e.entry_id[:12],
            videos.get(e.video, "?"),
            f"{e.fps:g}",
            "-" if e.max_frames is None else str(e.max_frames),
            model_name(e.model),
            e.dtype,
            shards,
            str(e.frames),
            _human(e.bytes),
            _dt.datetime.fromtimestamp(e.modified).strftime("%Y-%m-%d %H:%M"),
            f"[yellow]{stale}[/yellow]" if (stale := cache.is_stale(e)) else "ok",
        )
    console.print(table)
    total += _saved_tables(console, dir)
    console.print(
        f"{len(entries)} entries, {_human(total)} with the saved prompts and visual K/V. Remove "
        "with `lvx cache rm ID|VIDEO`, `lvx cache rm --stale` or `lvx cache clear`."
    )


@cache_app.command("rm")
def rm(
    targets: List[str] = typer.Argument(
        None, help="Entry ids (or their first 4+ characters) or video paths.", metavar="ID|VIDEO..."
    ),
    stale: bool = typer.Option(
        False, "--stale", help="Remove entries whose video is missing or has changed."
    ),
    cache_dir: Optional[Path] = DirOption,
    old_dir: Optional[Path] = OldDirOption,
) -> None:
    """Remove some entries.

    The features, saved prompts and visual K/V of videos (by path) or entry ids."""
    dir = _folder(cache_dir, old_dir)
    cache = _cache(dir)
    console = Console()
    if stale:
        n, failure = _attempt([cache.remove_stale], cache.root)
        console.print(f"Removed {n} stale entr{'y' if n == 1 else 'ies'}.")
        _fail_on(console, failure)
    elif not targets:
        console.print(
            "[red]Name what to remove[/red]: entry ids or video paths (see `lvx cache ls`), or "
            "--stale."
        )
        raise typer.Exit(2)
    missing = []
    stores = [cache, *_saved(dir).values()]
    for target in targets or []:
        n, failure = _attempt(
            [lambda store=store: store.remove(target) for store in stores], cache.root
        )
        if n:
            console.print(f"Removed {_entries(n)} for {target}.", markup=False)
        _fail_on(console, failure)
        if not n:
            missing.append(target)
    if missing:
        console.print(
            f"[red]Nothing cached matches {escape(', '.join(missing))}[/red]; see `lvx cache ls` "
            "for the ids."
        )
        raise typer.Exit(1)


@cache_app.command("clear")
def clear(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    cache_dir: Optional[Path] = DirOption,
    old_dir: Optional[Path] = OldDirOption,
) -> None:
    """Remove every entry.

    Every cached video, saved prompt and saved visual K/V."""
    dir = _folder(cache_dir, old_dir)
    cache, saved = _cache(dir), list(_saved(dir).values())
    size = cache.size_bytes() + sum(store.size_bytes() for store in saved)
    if not cache.entries() and not any(store.entries() for store in saved):
        Console().print(f"The cache at {cache.root} is empty: nothing to remove.")
        return
    if not yes and not typer.confirm(
        f"Delete all cached features, saved prompts and visual K/V in {cache.root} "
        f"({_human(size)})?"
    ):
        raise typer.Exit(1)
    console = Console()
    n, failure = _attempt([store.clear for store in (cache, *saved)], cache.root)
    freed = "" if failure else f" ({_human(size)})"
    console.print(f"Removed {n} entries{freed} from {cache.root}.", markup=False)
    _fail_on(console, failure)
    left = [f for store in (cache, *saved) for f in store.leftovers()]
    if left:
        console.print(
            f"Left {len(left)} file(s) lvx did not write, such as {left[0]}.",
            soft_wrap=True,
            markup=False,
        )
