"""`lvx finetune`: a thin typer command over `lvx_app.train.loop` (register `finetune_command` on
the app).

One rank runs in this process; more run as a local torchrun group (`python -m
lvx_app.parallel.torchrun`, torch's launcher minus its failure traceback, with the worker `python -m
lvx_app.train.worker`). Multi-node: run that same worker module under `torchrun --nnodes ...
--rdzv-endpoint ...` with `--config` holding the TrainConfig JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from lvx_app.cli_options import CACHE_DIR, DECODE_TIMEOUT, LAYOUT
from lvx_app.defaults import DEFAULT_MODEL, check_layout, check_seconds


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", err=True, fg="red")
    raise typer.Exit(1)


def finetune_command(
    data: Path = typer.Option(
        ...,
        "--data",
        help="JSONL file: one {video, conversations} or {video, question, answer} sample per line.",
    ),
    video_dir: Optional[Path] = typer.Option(
        None,
        "--video-dir",
        help="Folder the samples' video names are relative to (default: the data file's folder).",
    ),
    model: str = typer.Option(
        DEFAULT_MODEL, "--model", help="mPLUG-Owl3 checkpoint directory or hub id to start from."
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        help="Output checkpoint folder (official layout, loadable with "
        "lvx chat --model OUT) with the resume state and loss.png.",
    ),
    gpus: Optional[int] = typer.Option(
        None, "--gpus", help="GPUs, one rank each (default: 1 if a GPU is visible, else 0 = CPU)."
    ),
    ranks: Optional[int] = typer.Option(
        None, "--ranks", help="CPU ranks when --gpus 0 (gloo); default 1."
    ),
    fps: float = typer.Option(1.0, "--fps", help="Frames sampled per second of video."),
    max_frames: Optional[int] = typer.Option(
        None, "--max-frames", help="Cap on frames per video (thinned uniformly)."
    ),
    recompute: bool = typer.Option(
        True,
        "--recompute/--no-recompute",
        help="Recompute each hyper layer's visual "
        "K/V in backward from one shared copy of the features (LV-XAttn), or save "
        "them per layer.",
    ),
    lora: Optional[int] = typer.Option(
        None,
        "--lora",
        help="Train LoRA adapters of this rank on the attention projections (incl. v_kv_proj).",
    ),
    train: Optional[str] = typer.Option(
        None,
        "--train",
        help="Train 'hyper' (v_kv_proj + gates, the default) or "
        "'all' (language model + projector; the vision tower stays frozen).",
    ),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW, warm-up then cosine)."),
    steps: int = typer.Option(100, "--steps", help="Optimizer steps (one sample each)."),
    save_every: int = typer.Option(
        50,
        "--save-every",
        help="Also save every N steps, so a crash loses little (0: only at the end).",
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the state saved in --out."),
    checkpoint_lm: bool = typer.Option(
        False,
        "--checkpoint-lm",
        help="Checkpoint the decoder layers at their "
        "attention outputs (less activation memory, attention not re-run).",
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="Weights: auto (bfloat16 on GPU + float32 trainable "
        "copies, float32 on CPU), float32, bfloat16.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for LoRA init and the sample order."),
    cache_dir: Optional[Path] = CACHE_DIR,
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a rank waits for a hung peer."),
    decode_timeout: float = DECODE_TIMEOUT,
    layout: str = LAYOUT,
) -> None:
    # long: to be split: it mixes several steps
    """Finetune mPLUG-Owl3 on long videos with LV-XAttn (K/V recomputed from one copy of the
    features)."""
    # the signature is the command's option list; the work is in _checked_mode, _check_run and
    # run_finetune
    from lvx_app.train.loop import TrainConfig

    mode = _checked_mode(lora, train, steps, timeout, decode_timeout, layout)
    world, cuda = _check_run(gpus, ranks, data, video_dir, out, model, resume)
    cfg = TrainConfig(
        data=str(data),
        model=model,
        out=str(out),
        video_dir=str(video_dir) if video_dir else None,
        fps=fps,
        max_frames=max_frames,
        recompute=recompute,
        train=mode,
        lora_rank=lora or 16,
        lr=lr,
        steps=steps,
        save_every=save_every,
        checkpoint_lm=checkpoint_lm,
        resume=resume,
        seed=seed,
        dtype=dtype,
        cuda=cuda,
        cache_dir=str(cache_dir) if cache_dir else None,
        timeout_s=timeout,
        decode_timeout_s=decode_timeout,
        layout=layout,
    )
    lock = _lock_out(out, resume)
    try:
        code = run_finetune(cfg, world, keep_fds=(lock,))
    finally:
        os.close(lock)
    if code:
        raise typer.Exit(code)
    typer.echo(
        f"saved {out} (load it with: lvx chat VIDEO --model {out}); loss curve: {out / 'loss.png'}"
    )


def _checked_mode(
    lora: int | None,
    train: str | None,
    steps: int,
    timeout: float,
    decode_timeout: float,
    layout: str,
) -> str:
    """What to train ("lora", "hyper" or "all"), once the options that need no files are checked."""
    if lora is not None and train is not None:
        _fail("use either --lora R or --train hyper|all, not both")
    mode = "lora" if lora is not None else (train or "hyper")
    if mode not in ("lora", "hyper", "all"):
        _fail(f"--train must be hyper or all, not {train!r} (or use --lora R)")
    if steps < 1:
        _fail("--steps must be at least 1")
    try:
        check_seconds({"--timeout": timeout, "--decode-timeout": decode_timeout})
        check_layout(layout)
    except ValueError as exc:
        _fail(str(exc))
    return mode


def _check_run(
    gpus: int | None,
    ranks: int | None,
    data: Path,
    video_dir: Path | None,
    out: Path,
    model: str,
    resume: bool,
) -> tuple[int, bool]:
    """(ranks, use CUDA), once the devices, the data and the output folder are checked: before
    anything is written."""
    # imported here, not at the top: the CLI registers this command without loading torch
    from lvx_app.engine.api import EngineError
    from lvx_app.engine.open import resolve_world
    from lvx_app.train.checkpoint import STATE_FILE
    from lvx_app.train.data import DataError, load_jsonl
    from lvx_app.train.outlock import OutputBusy, check_out_is_not_model

    try:
        check_out_is_not_model(out, model)
        world, cuda = resolve_world(gpus, ranks)
        load_jsonl(data, video_dir)  # check the data before starting ranks
    except (EngineError, DataError, OutputBusy) as exc:
        _fail(str(exc))
    if resume and not (out / STATE_FILE).exists():
        _fail(f"no {STATE_FILE} in {out} to resume from; run without --resume to start fresh")
    return world, cuda


def _lock_out(out: Path, resume: bool) -> int:
    """Hold `out` for this run (one line naming the holder's pid if another run has it); returns the
    lock's fd."""
    from lvx_app.train.checkpoint import STATE_FILE
    from lvx_app.train.outlock import OutputBusy, lock_output

    try:
        lock = lock_output(out)
    except OutputBusy as exc:
        _fail(str(exc))
    if not resume and (out / STATE_FILE).exists():
        os.close(lock)
        _fail(
            f"{out} already holds a finetuning run; pass --resume to continue it, or choose "
            "another --out"
        )
    return lock


def _interrupted(out: str) -> int:
    typer.secho(
        f"interrupted: the last checkpoint in {out} (every --save-every steps) is kept; "
        "rerun with --resume to continue from it",
        err=True,
        fg="yellow",
    )
    return 130


def run_finetune(cfg, world: int, keep_fds: tuple[int, ...] = ()) -> int:
    """Run `cfg` on `world` ranks: in this process for one, else a local torchrun group; returns an
    exit code.

    The group's launcher inherits `keep_fds` (the output folder's lock) and dies with this process,
    its ranks with it.
    """
    if world == 1:
        from lvx_app.parallel.group import destroy_distributed, init_distributed
        from lvx_app.train.loop import run_training
        from lvx_app.train.worker import user_errors

        try:
            info = init_distributed(cuda=cfg.cuda, timeout_s=cfg.timeout_s)
            run_training(cfg, info.device)
        except user_errors() as exc:
            typer.secho(f"error: {exc}", err=True, fg="red")
            return 1
        except KeyboardInterrupt:
            return _interrupted(cfg.out)
        finally:
            destroy_distributed()
        return 0
    from lvx_app.parallel.lifeline import mark_launcher

    env = dict(os.environ)
    if not cfg.cuda:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    cmd = [
        sys.executable,
        "-m",
        "lvx_app.parallel.torchrun",
        "--standalone",
        f"--nproc-per-node={world}",
        "--monitor-interval=0.5",
        "-m",
        "lvx_app.train.worker",
        "--config",
        json.dumps(dataclasses.asdict(cfg)),
    ]
    proc = subprocess.Popen(cmd, env=mark_launcher(env), pass_fds=keep_fds)
    try:
        proc.wait()
    except KeyboardInterrupt:  # the group got the same Ctrl-C; let torchrun stop its ranks
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return _interrupted(cfg.out)
    if proc.returncode == 130:  # the ranks or torchrun were stopped by Ctrl-C / SIGTERM
        return _interrupted(cfg.out)
    if proc.returncode not in (
        0,
        1,
    ):  # 1: the launcher printed the line naming the rank that failed first
        typer.secho(
            f"error: the finetuning group failed (exit {proc.returncode})", err=True, fg="red"
        )
    return proc.returncode
