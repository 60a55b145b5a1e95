"""`lvx eval …`: Video-MME runs, shard merging and reports. Thin commands over `lvx_app.eval`.

`lvx eval merge` and `lvx eval report` never import torch: only `videomme` starts the engine.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from lvx_app.cli.options import config_options, exit_code, fail, new_app
from lvx_app.config import Config
from lvx_app.eval.dataset import DatasetError
from lvx_app.eval.extract import SCORING_MODES
from lvx_app.eval.report import report_file
from lvx_app.eval.results import ResultsError, merge_results

eval_app = new_app(
    "eval", "Batch evaluation on Video-MME: run (resumable, shardable), merge shard files, report."
)


def open_engine_session(config: Config):
    """The engine behind an eval: each question is answered on a fresh conversation."""
    # imported here: `lvx eval merge/report` run without torch
    from lvx_app.eval.runner import EngineEvalSession
    from lvx_app.runtime.open import open_engine

    return EngineEvalSession(open_engine(config))


@eval_app.command()
@config_options(
    "model",
    "video",
    "parallel",
    "generation",
    "eval",
    include=(
        *("path", "revision", "dtype", "fps", "max_frames", "kv_mode", "cache", "cache_dir"),
        *("decode_timeout_s", "gpus", "ranks", "layout", "xattn_schedule", "timeout_s"),
        *("max_new_tokens", "data", "out", "questions", "eval.subtitles", "limit"),
        *("durations", "shard", "scoring", "attn_backend"),
    ),
    defaults={"max_new_tokens": 16},
)
def videomme(*, config: Config) -> None:
    """Answer Video-MME, resumably, and report it.

    Accuracy by duration, domain, sub-category and task type."""
    from lvx_app.engine.records import EngineError
    from lvx_app.eval.videomme import run_videomme

    try:
        run_videomme(config, lambda: open_engine_session(config))
    except (DatasetError, ResultsError, EngineError) as e:  # one sentence, no traceback
        raise fail(str(e), exit_code(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@eval_app.command()
def merge(
    out: Path = typer.Argument(..., help="New merged results file.", metavar="OUT"),
    inputs: list[Path] = typer.Argument(..., help="Shard results files.", metavar="SHARD..."),
    keep_first: bool = typer.Option(
        False, "--keep-first", help="On a question answered twice keep the first file's answer."
    ),
    scoring: str = typer.Option(
        "official", "--scoring", help="official or strict.", metavar="official|strict"
    ),
) -> None:
    """Combine shard results files and report them.

    The files must share their settings and answer no question twice."""
    if scoring not in SCORING_MODES:
        raise fail(f"--scoring must be one of {', '.join(SCORING_MODES)}.")
    try:
        merged = merge_results(inputs, out, keep_first=keep_first)
    except ResultsError as e:
        raise fail(str(e), exit_code(e)) from None
    Console().print(f"merged {merged.records} answers from {len(inputs)} file(s) into {merged.out}")
    report_file(merged.out, scoring)


@eval_app.command()
def report(
    results: Path = typer.Argument(..., help="Results JSONL.", metavar="RESULTS"),
    scoring: str = typer.Option(
        "official", "--scoring", help="official or strict.", metavar="official|strict"
    ),
) -> None:
    """Re-score a results file.

    Rewrites its summary, plot and official JSON in either scoring mode."""
    if scoring not in SCORING_MODES:
        raise fail(f"--scoring must be one of {', '.join(SCORING_MODES)}.")
    if not results.is_file():
        raise fail(f"{results} does not exist.")
    try:
        report_file(results, scoring)
    except ResultsError as e:
        raise fail(str(e), exit_code(e)) from None
