"""Balanced layouts: every frame and token dealt once, the per-round work even, and sharded sessions
on every layout answering like one process."""

from __future__ import annotations

import pytest
import torch

from lvx_app.cache import FeatureKey
from lvx_app.defaults import LAYOUTS
from lvx_app.engine.records import VideoRequest
from lvx_app.parallel.layout import balance, owned, owners, rank_tokens, round_work, token_owners
from lvx_app.video.plan import build_plan
from scripts.gloo_ranks import run_ranks


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("total", [0, 1, 3, 7, 48, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_item_dealt_once_and_sorted(layout, total, world):
    shares = [owned(total, world, r, layout) for r in range(world)]
    assert sorted(sum(shares, [])) == list(range(total))
    assert all(s == sorted(s) for s in shares)
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= (1 if layout != "zigzag" else 2)


def test_known_layouts_of_ten_frames_on_three_ranks():
    assert [owned(10, 3, r, "contiguous") for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [owned(10, 3, r, "striped") for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [owned(10, 3, r, "zigzag") for r in range(3)] == [[0, 1, 9], [2, 3, 8], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="use one of contiguous, striped, zigzag"):
        owners(10, 3, "diagonal")


def test_tokens_travel_with_their_frame_and_the_tail_is_dealt_by_layout():
    # 4 frames, placeholders of 4 tokens; tokens 0-1 come before the first frame
    starts = [2, 6, 10, 14]
    frame_rank = owners(4, 2, "zigzag").tolist()
    assert frame_rank == [0, 1, 1, 0]
    who = token_owners(20, starts, 2, "zigzag")
    assert who[:18].tolist() == [0] * 6 + [1] * 8 + [0] * 4
    tail = token_owners(20, starts, 2, "zigzag", tail_from=16)
    assert tail[16:].tolist() == owners(4, 2, "zigzag").tolist()
    assert rank_tokens(20, starts, 2, 1, "striped").tolist() == list(range(6, 10)) + list(
        range(14, 20)
    )
    assert token_owners(5, [], 3, "contiguous").tolist() == [0, 0, 1, 1, 2]  # no frames: all tail


def _video_prompt_work(
    world: int, layout: str, frames: int = 48, per_frame: int = 5
) -> torch.Tensor:
    starts = torch.arange(frames) * per_frame + 3
    n = int(starts[-1]) + per_frame
    q_vis = torch.searchsorted(starts, torch.arange(n), right=True)
    return round_work(
        q_vis,
        token_owners(n, starts, world, layout),
        torch.arange(frames),
        owners(frames, world, layout),
        world,
    )


def test_round_work_counts_every_visible_pair_once():
    work = _video_prompt_work(2, "contiguous")
    assert work.shape == (2, 2)
    # a token of frame f sees frames 0..f
    assert int(work.sum()) == sum(5 * (f + 1) for f in range(48))
    # round 1: rank 0 meets rank 1's tokens, which see all of rank 0's frames
    assert int(work[1, 0]) == 24 * 5 * 24
    # round 1: rank 1 meets rank 0's tokens; none sees a frame of rank 1
    assert int(work[1, 1]) == 0


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_every_round_and_contiguous_does_not(world):
    assert balance(_video_prompt_work(world, "zigzag")) <= 1.15
    assert balance(_video_prompt_work(world, "contiguous")) >= 1.4


def test_plan_shards_follow_the_layout_and_cache_keys_differ():
    plan = build_plan(300, 30.0, 1.0, warn=False)
    for layout in LAYOUTS:
        shards = plan.shards(3, layout)
        assert sorted(sum((list(s.positions) for s in shards), [])) == list(range(len(plan)))
        for s in shards:
            assert list(s.indices) == [plan.indices[p] for p in s.positions]
            assert s.positions == tuple(owned(len(plan), 3, s.rank, layout))
    ids = {
        layout: FeatureKey(
            "f", 1.0, None, "m", "", "float32", 2, 0, layout=layout, plan_version=1
        ).entry_id()
        for layout in LAYOUTS
    }
    assert len(set(ids.values())) == len(LAYOUTS)


def _first_turn(rank: int, world: int, checkpoint: str, video: str, cache_dir: str, layout: str):
    """Load the video, prefill one question and decode two tokens; return the logits and this rank's
    frames."""
    from lvx_app.config import Config
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed

    cfg = Config.from_options(
        model=checkpoint, cache_dir=cache_dir, decode_workers=1, layout=layout, dtype="float32"
    )
    session = RankSession(cfg, init_distributed(cuda=False))
    session.load_video(VideoRequest(video, session.config.video))
    frames = sorted(set(session.conversation.visual.k_frame.values.flatten().tolist()))
    logits, owner = session.conversation.prefill(session.turns.question_ids("what happens?"))
    box = torch.zeros(logits.shape[-1] if logits is not None else session.model.config.vocab_size)
    if rank == owner:
        box = logits.float()
    if world > 1:
        torch.distributed.all_reduce(box)
    steps = [box]
    for _ in range(2):
        steps.append(session.conversation.feed(int(steps[-1].argmax())).float())
    return [s.numpy() for s in steps], frames, int(session.video.loaded.prefix_ids.numel())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_sharded_session_on_every_layout_matches_one_process(
    tiny_checkpoints, short_video, tmp_path, layout
):
    checkpoint = tiny_checkpoints["g2"]
    ref, _, _ = run_ranks(
        _first_turn, 1, checkpoint, short_video, str(tmp_path / "c1"), "contiguous"
    )[0]
    for world in (2, 3):
        got = run_ranks(
            _first_turn, world, checkpoint, short_video, str(tmp_path / f"c{world}"), layout
        )
        for rank, (steps, frames, _) in enumerate(got):
            assert frames == owned(10, world, rank, layout), (world, rank)
        for a, b in zip(got[0][0], ref):
            torch.testing.assert_close(
                torch.from_numpy(a), torch.from_numpy(b), atol=2e-5, rtol=1e-4
            )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tile_plans_compute_about_the_triangle_on_every_layout(layout):
    """Sorted local frames keep the visible keys a prefix per token, and tiles cut where that prefix
    grows: the kernels see little more than the visible pairs, not the rectangle of a tile's whole
    key span."""
    from lvx_kernels import masks

    frames, per_frame, keys_per_frame, world, group = 96, 5, 4, 2, 7
    starts = torch.arange(frames) * per_frame
    n = frames * per_frame
    q_vis_all = torch.searchsorted(starts, torch.arange(n), right=True)
    for rank in range(world):
        tokens = rank_tokens(n, starts, world, rank, layout)
        k_frame = (
            torch.tensor(owned(frames, world, rank, layout))
            .repeat_interleave(keys_per_frame)
            .view(1, -1)
        )
        for src in range(world):  # every query block this rank meets in the ring
            qv = (
                q_vis_all[rank_tokens(n, starts, world, src, layout)]
                .repeat_interleave(group)
                .view(1, -1)
            )
            q, k = torch.empty(1, qv.shape[1], 1, 8), torch.empty(1, k_frame.shape[1], 1, 8)
            area = sum(
                (p.q1 - p.q0) * (p.k1 - p.k0)
                for p in masks.tile_plans(q, k, False, qv, k_frame, group)
            )
            visible = int((k_frame.view(1, -1) < qv.view(-1, 1)).sum())
            assert area <= 1.35 * visible + 1, (layout, rank, src, area, visible)
    assert tokens.numel() > masks.MIN_TILE  # several tiles per block


def _ingest_rank(rank: int, world: int, path: str, cache_dir: str, layout: str):
    from videos import IndexEncoder

    from lvx_app.config import VideoConfig
    from lvx_app.video import Encoder, IngestTuning, ingest

    shard = ingest(
        path,
        Encoder(IndexEncoder(), image_size=32),
        VideoConfig(fps=1.0, cache_dir=cache_dir, decode_workers=1),
        device="cpu",
        progress=False,
        layout=layout,
        tuning=IngestTuning(decode_threads=1, chunk_frames=2),
    )
    return (
        shard.features.numpy(),
        shard.positions.tolist(),
        shard.from_cache,
        list(shard.plan.indices),
    )


@pytest.mark.slow
def test_ingest_decodes_the_layouts_frames_and_the_cache_never_hands_another_layouts_shard(
    short_video, tmp_path
):
    from videos import index_from_features

    done: set[str] = set()
    for layout in (
        "contiguous",
        "zigzag",
        "striped",
        "zigzag",
    ):  # one cache folder: only the second zigzag hits
        got = run_ranks(_ingest_rank, 2, short_video, str(tmp_path), layout)
        for rank, (features, positions, from_cache, indices) in enumerate(got):
            assert positions == owned(len(indices), 2, rank, layout)
            assert index_from_features(torch.from_numpy(features)) == [
                indices[p] for p in positions
            ]
            assert from_cache == (layout in done), (layout, rank)
        done.add(layout)


def test_layout_option_reaches_chat_and_finetune_and_a_bad_one_is_one_line(tmp_path, monkeypatch):
    """`--layout` on chat and finetune ends in the session / training config; an unknown name is one
    error line naming the choices, before any model is loaded."""
    from typer.testing import CliRunner

    import lvx_app.cli.chat as terminal
    import lvx_app.cli.finetune as train_cli
    from lvx_app.cli.main import app

    seen = {}

    def fake_chat(video, config, console=None):  # the real one would load a model
        seen["chat"] = config.parallel.layout
        return 0

    bad = CliRunner().invoke(app, ["chat", str(tmp_path / "v.mp4"), "--layout", "diagonal"])
    assert bad.exit_code == 2
    assert bad.stderr.strip().splitlines() == [
        "error: unknown --layout 'diagonal'; use one of contiguous, striped, zigzag"
    ]
    monkeypatch.setattr(terminal, "run_chat_command", fake_chat)
    assert CliRunner().invoke(app, ["chat", "v.mp4", "--layout", "striped"]).exit_code == 0
    assert seen["chat"] == "striped"

    import json

    (tmp_path / "v.mp4").write_bytes(b"")  # the data check wants the file; nothing decodes it here
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"video": "v.mp4", "question": "What?", "answer": "This."}) + "\n")
    monkeypatch.setattr(
        train_cli,
        "_run_alone",
        lambda config, world: seen.setdefault("train", config.parallel.layout) and 0,
    )
    args = [
        "finetune",
        "--data",
        str(data),
        "--video-dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "out"),
        "--gpus",
        "0",
    ]
    assert CliRunner().invoke(app, [*args, "--layout", "contiguous"]).exit_code == 0, "finetune ran"
    assert seen["train"] == "contiguous"
    bad = CliRunner().invoke(app, [*args, "--layout", "diagonal"])
    assert bad.exit_code == 2
    assert "unknown --layout 'diagonal'; use one of contiguous, striped, zigzag" in bad.stderr
