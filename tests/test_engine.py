"""The engine: sharded sessions answer exactly like one process running the token loop over the
whole conversation."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from engine_configs import engine_config
from test_generation_cache import generate
from timing import scaled

from lvx_app.config import GenerationConfig
from lvx_app.engine.describe import printable
from lvx_app.engine.records import EngineError, GroupFailed
from lvx_app.engine.session import RankSession
from lvx_app.parallel.world import World
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from scripts.baselines.engine import baseline_parallelize
from scripts.gloo_ranks import run_ranks

QUESTIONS = ("what happens in the video?", "and after that?")
PARAMS = GenerationConfig(max_new_tokens=10)


def _config(checkpoint: str, cache_dir: str, **kw):
    return engine_config(checkpoint, cache_dir, max_new_tokens=PARAMS.max_new_tokens, **kw)


def _conversation(
    rank: int,
    world: int,
    checkpoint: str,
    video: str,
    cache_dir: str,
    kv_mode: str,
    schedule: str = "auto",
    attention: str = "LV-XAttn",
):
    """Every rank runs the SPMD session; rank 0 drives two turns, a reset, one more turn, and a
    reload."""
    from lvx_app.parallel.group import init_distributed

    config = _config(checkpoint, cache_dir, kv_mode=kv_mode, xattn_schedule=schedule)
    session = RankSession(config, init_distributed(cuda=False), baseline_parallelize(attention))
    channel = ControlChannel()
    if rank != 0:
        worker_loop(session, channel)
        return None
    engine = GroupDriver(session, channel, config)
    first = engine.load_video(video)
    answers = ["".join(engine.ask(q)) for q in QUESTIONS]
    engine.reset()
    answers.append("".join(engine.ask(QUESTIONS[0])))
    again = engine.load_video(video)
    stats = engine.stats()
    engine.close()
    sent = [r.get("attention bytes sent", 0) for r in stats["ranks"]]
    return (
        answers,
        first.frames,
        first.from_cache,
        again.from_cache,
        [r["rank"] for r in stats["ranks"]],
        sent,
    )


def _reference(checkpoint: str, video: str, subtitles: list | None = None) -> list[str]:
    """One process, one model, the token loop over the whole conversation, re-prefilled from scratch
    each turn (stopping at the checkpoint's eos token). `subtitles` (cues): their lines at the
    sampled frames follow the video."""
    from lvx_app.config import VideoConfig
    from lvx_app.subtitles import select_lines, subtitle_block
    from lvx_app.video import Encoder, ingest
    from lvx_models.mplug_owl3.loader import load_model

    model, _, proc = load_model(checkpoint)
    encoder = Encoder(model.encode_images, image_size=proc.image_size)
    video_config = VideoConfig(fps=1.0, cache=False, decode_workers=1)
    shard = ingest(video, encoder, video_config, progress=False)
    n = shard.num_frames
    block = subtitle_block(select_lines(subtitles or [], shard.plan.timestamps))
    content = "<|video|>\n" + (block + "\n" if block else "") + QUESTIONS[0]
    prompt = proc.build_chat_prompt([{"role": "user", "content": content}], videos=[n])
    visual = model.prepare_visual(shard.features, torch.tensor(prompt.media_starts))
    ids = prompt.input_ids
    answers, out = [], []
    for i, question in enumerate(QUESTIONS):
        if i:
            ids = torch.cat([ids, torch.tensor(out + [proc.stop_ids[0]])])
            ids = torch.cat([ids, proc.build_followup(question, offset=len(ids)).input_ids])
        out = generate(
            model,
            ids.view(1, -1),
            visual=visual,
            max_new_tokens=PARAMS.max_new_tokens,
            stop_ids=[model.config.eos_token_id],
        )
        if out[-1] in proc.stop_ids:
            out = out[:-1]
        answers.append(proc.decode(out))
    return answers


# (ranks, K/V mode, schedule) each generation runs: the newest every one, the others each
# distributed path once (auto: short questions take the gather schedule; ring: the question
# sharded, its text K/V replicated after)
SHARDED_RUNS = {
    "g2": (
        (1, "cache", "auto"),
        (2, "cache", "auto"),
        (3, "recompute", "auto"),
        (3, "cache", "ring"),
    ),
    "g1": ((2, "cache", "auto"), (3, "recompute", "auto")),
    "g1-gateproj": ((2, "cache", "auto"), (3, "cache", "ring")),
}


@pytest.mark.slow
@pytest.mark.parametrize("generation", list(SHARDED_RUNS))
def test_sharded_engine_answers_like_one_process(
    tiny_checkpoints, short_video, tmp_path, generation
):
    checkpoint = tiny_checkpoints[generation]
    expected = _reference(checkpoint, short_video)
    for world, kv_mode, schedule in SHARDED_RUNS[generation]:
        answers, frames, cached_first, cached_again, ranks, _ = run_ranks(
            _conversation,
            world,
            checkpoint,
            short_video,
            str(tmp_path / f"cache{world}{schedule}"),
            kv_mode,
            schedule,
        )[0]
        assert frames == 10
        assert answers[:2] == expected, (world, kv_mode, schedule)
        assert answers[2] == expected[0], "reset must forget the conversation but keep the video"
        assert (cached_first, cached_again) == (False, True)
        assert ranks == list(range(world))


@pytest.mark.slow
def test_ring_and_allgather_baselines_answer_like_one_process(
    tiny_checkpoints, short_video, tmp_path
):
    """The benchmarks' baselines, installed from outside (scripts/baselines/engine.py), run the same
    chat on the newest generation (the benchmarks' model): same tokens, and K/V really travel."""
    checkpoint = tiny_checkpoints["g2"]
    expected = _reference(checkpoint, short_video)
    sent = {}
    for attention in ("Ring pass-KV", "all-gather K/V", "LV-XAttn"):
        cache = str(tmp_path / attention.replace(" ", "_").replace("/", ""))
        answers, _, _, _, _, sent[attention] = run_ranks(
            _conversation, 2, checkpoint, short_video, cache, "cache", "auto", attention
        )[0]
        assert answers[:2] == expected, attention
        assert answers[2] == expected[0], attention
    # K/V of the whole video and prompt move, not just queries and outputs
    for attention in ("Ring pass-KV", "all-gather K/V"):
        assert min(sent[attention]) > max(sent["LV-XAttn"]) > 0, sent


def test_local_engine_interrupt_and_errors(tiny_checkpoints, short_video, tmp_path):
    from lvx_app.runtime.open import open_engine

    config = _config(tiny_checkpoints["g2"], str(tmp_path), gpus=None, ranks=1)
    engine = open_engine(config)
    assert engine.session.config is config and config.parallel.gpus is None, (
        "the devices are resolved into a World of their own; the config stays as it was"
    )
    with pytest.raises(EngineError, match="no video is loaded"):
        list(engine.ask("hello?"))
    with pytest.raises(EngineError, match="not found"):
        engine.load_video(str(tmp_path / "missing.mp4"))
    engine.load_video(short_video)
    with pytest.raises(EngineError, match="empty"):
        list(engine.ask("   "))
    pieces = []
    for piece in engine.ask(QUESTIONS[0], max_new_tokens=50):
        pieces.append(piece)
        engine.interrupt()
    assert engine.last_answer.interrupted and engine.last_answer.new_tokens == len(pieces) >= 1
    full = "".join(engine.ask(QUESTIONS[0], max_new_tokens=5))
    assert full and not engine.last_answer.interrupted
    engine.close()


def _lvx(*args: str, stdin: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lvx_app.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        env=env,
    )


@pytest.mark.slow
def test_lvx_chat_through_stdin_on_two_ranks(tiny_checkpoints, short_video, tmp_path):
    checkpoint = tiny_checkpoints["g2"]
    expected = _reference(checkpoint, short_video)
    stdin = "\n".join([*QUESTIONS, "/stats", "/quit"]) + "\n"
    result = _lvx(
        "chat",
        short_video,
        "--model",
        checkpoint,
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--max-new-tokens",
        str(PARAMS.max_new_tokens),
        "--cache-dir",
        str(tmp_path),
        stdin=stdin,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "10 frames at 1 fps" in out
    for answer in expected:
        assert f"lvx › {printable(answer)}\n" in out, out
    assert "TTFT" in out and "tok/s" in out
    assert "world size: 2" in out or "world size" in out


@pytest.mark.slow
def test_lvx_chat_bad_video_is_one_line(tmp_path):
    result = _lvx("chat", str(tmp_path / "nope.mp4"), "--gpus", "0")
    assert result.returncode == 2
    assert "error:" in result.stdout and "not found" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_lvx_chat_decode_timeout_reaches_the_decoder(tiny_checkpoints, short_video, tmp_path):
    """--decode-timeout is what the decode workers wait for; a value too small for any video fails
    in one line."""
    result = _lvx(
        "chat",
        short_video,
        "--model",
        tiny_checkpoints["g2"],
        "--gpus",
        "0",
        "--decode-timeout",
        "0.001",
        "--no-cache",
        stdin="/quit\n",
    )
    assert result.returncode != 0, result.stdout
    assert (
        "did not answer within 0.001 s" in result.stdout
        and "raise --decode-timeout" in result.stdout
    ), result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    bad = _lvx("chat", short_video, "--decode-timeout", "0")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "--decode-timeout must be a number of seconds above 0" in bad.stderr


@pytest.mark.slow
def test_lvx_demo_runs(tmp_path):
    result = _lvx("demo", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lvx demo timings (2 cpu rank(s))" in result.stdout
    assert "decode + encode video" in result.stdout and "answer 2 (TTFT)" in result.stdout
    seen = re.findall(r"^seen at \d+:\d\d.* \(\d+%\)", result.stdout, re.MULTILINE)
    assert len(seen) == 2, f"each answer's moments: {result.stdout}"
    raw = {c for c in result.stdout if c not in "\n\t" and (ord(c) < 32 or 0x7F <= ord(c) < 0xA0)}
    assert not raw, f"raw control characters in the demo's answers: {raw}"


@pytest.mark.slow
def test_killed_rank_ends_the_group_with_a_clear_error(tiny_checkpoints, short_video, tmp_path):
    from lvx_app.runtime.launcher import RemoteEngine, pid_file

    config = _config(tiny_checkpoints["g2"], str(tmp_path), timeout_s=30, gpus=0)
    engine = RemoteEngine(config, World(2))
    try:
        engine.load_video(short_video)
        os.kill(int(pid_file(engine.run_dir, 1).read_text()), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(GroupFailed, match=r"rank 1 failed"):
            for _ in range(3):  # the first request may still be answered before torchrun notices
                list(engine.ask(QUESTIONS[0], max_new_tokens=50))
                time.sleep(1)
        assert time.monotonic() - t0 < scaled(60)
    finally:
        engine.close()


def test_describe_failure_names_the_killed_rank_not_the_one_that_lost_its_peer(tmp_path):
    """The launcher's one line is the reason; without it, the rank that left an error."""
    from lvx_app.runtime.launcher import describe_failure, error_file

    (tmp_path / "group.log").write_text(
        "lvx worker rank 0: RuntimeError: Connection reset by peer\n"
        "error: rank 1 failed: killed by SIGKILL (out of memory, a crash, or by hand)\n"
    )
    assert (
        describe_failure(tmp_path, 1)
        == "rank 1 failed: killed by SIGKILL (out of memory, a crash, or by hand)"
    )
    (tmp_path / "group.log").write_text("")
    error_file(tmp_path, 0).write_text(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    assert (
        describe_failure(tmp_path, 1)
        == "rank 0 failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
