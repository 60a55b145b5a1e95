"""Where an answer looked: per-frame shares of the visual attention, exact against a float64
softmax on 1, 2 and 4 ranks (every layout, every checkpoint generation), a planted frame found
first (in the attention alone, and through the model from checkpoint weights on a video), the
moments made from the shares, and no recording when evidence is off."""

from __future__ import annotations

import math

import pytest
import torch
from engine_configs import engine_config
from planted import make_planted_video, plant_checkpoint
from test_serve_api import api_here  # noqa: F401 - the API on an engine in this process

from lvx_app.attention import frame_shares as attention_evidence
from lvx_app.attention.frame_shares import frame_lse, frame_shares
from lvx_app.engine.moments import moments, seen_line
from lvx_app.engine.records import Moment
from lvx_app.parallel.layout import owners
from scripts.gloo_ranks import run_ranks

HQ, HKV, D, P = 4, 2, 8, 5  # heads, K/V heads, head dim, keys per frame


def reference_shares(layers, num_frames: int, window: int | None = None) -> torch.Tensor:
    """The same softmax in float64 in one process, the K/V heads repeated per query head: each
    frame's summed probability, averaged over the (query, head, layer) rows that see a frame
    (`window`: only the latest `window` frames of those a row may see)."""
    total, rows = torch.zeros(num_frames, dtype=torch.float64), 0
    for q, q_vis, k, k_frame in layers:
        q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = torch.einsum("thd,shd->ths", q, k) / math.sqrt(q.shape[-1])
        hidden = k_frame.view(1, 1, -1) >= q_vis.view(-1, 1, 1)
        if window is not None:
            hidden |= k_frame.view(1, 1, -1) < q_vis.view(-1, 1, 1) - window
        scores = scores.masked_fill(hidden, -math.inf)
        seen = q_vis > 0
        prob = torch.softmax(scores[seen], dim=-1)  # (T', H, S)
        per_frame = torch.zeros(*prob.shape[:2], num_frames, dtype=torch.float64)
        per_frame.index_add_(2, k_frame, prob)
        total += per_frame.sum(dim=(0, 1))
        rows += int(seen.sum()) * q.shape[1]
    return total / max(rows, 1)


def _layers(seed: int, frames: int, tokens: int, planted: int | None = None):
    """Random queries and keys of two hyper layers; `planted`: that frame's keys are the queries'
    mean direction, scaled up (a frame the answer must find first)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        q = torch.randn(tokens, HQ, D, generator=g)
        k = torch.randn(frames * P, HKV, D, generator=g)
        k_frame = torch.arange(frames).repeat_interleave(P)
        q_vis = torch.randint(0, frames + 1, (tokens,), generator=g)
        q_vis[-1] = frames  # the answer's tokens see every frame
        if planted is not None:
            q_vis[:] = frames
            mean = q.view(tokens, HKV, HQ // HKV, D).mean(dim=(0, 2))  # (HKV, D)
            k[planted * P : (planted + 1) * P] = 4 * mean / mean.norm(dim=-1, keepdim=True)
        out.append((q, q_vis, k, k_frame))
    return out


def test_frame_lse_matches_float64_in_chunks(monkeypatch):
    monkeypatch.setattr(attention_evidence, "SCORE_CHUNK_ELEMENTS", 7 * 3 * HQ)  # split frames
    (q, q_vis, k, k_frame), _ = _layers(0, frames=6, tokens=7)
    got = frame_lse(q, k, q_vis, k_frame)
    order = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(9))
    shuffled = frame_lse(q, k[order], q_vis, k_frame[order])  # keys in any order: per key
    assert (shuffled - got).abs().nan_to_num().max() < 1e-5
    assert torch.equal(torch.isinf(shuffled), torch.isinf(got))
    kr = k.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("thd,shd->ths", q.double(), kr) / math.sqrt(D)
    for f in range(6):
        want = torch.logsumexp(scores[..., f * P : (f + 1) * P], dim=-1)
        want = torch.where((q_vis > f).view(-1, 1), want, -math.inf)
        assert torch.equal(torch.isinf(got[..., f]), torch.isinf(want))
        fin = torch.isfinite(want)
        assert (got[..., f].double()[fin] - want[fin]).abs().max() < 1e-5


def test_frame_shares_under_a_window_fall_only_on_the_frames_it_lets_a_query_see(monkeypatch):
    """Window 1 or 2 (`--media-attention latest-frame` is 1), keys in frame order or not, frames in
    chunks: exact against the float64 softmax, and no share on a frame no query's window holds."""
    monkeypatch.setattr(attention_evidence, "SCORE_CHUNK_ELEMENTS", 7 * 3 * HQ)
    layers = _layers(4, frames=6, tokens=7)
    for window in (1, 2):
        for order in (None, torch.randperm(30, generator=torch.Generator().manual_seed(2))):
            mixed = layers
            if order is not None:
                mixed = [(q, v, k[order], f[order]) for q, v, k, f in layers]
            got = frame_shares(mixed, 6, window=window)
            want = reference_shares(layers, 6, window)
            assert (got - want).abs().max() < 1e-6 and abs(float(got.sum()) - 1) < 1e-9
            windows = {
                f
                for _, q_vis, _, _ in layers
                for v in q_vis.tolist()
                for f in range(max(0, v - window), v)
            }
            assert all(share == 0 for f, share in enumerate(got.tolist()) if f not in windows)


def _distributed_shares(rank: int, world: int):
    """Every layout's shares on this group against the float64 reference, and the planted frame's
    rank among the shares."""
    import torch.distributed as dist

    results = []
    for layout in ("contiguous", "striped", "zigzag"):
        for seed, planted in ((1, None), (2, 3)):
            frames = 7
            layers = _layers(seed, frames, tokens=5, planted=planted)
            mine = owners(frames, world, layout) == rank
            local = []
            for q, q_vis, k, k_frame in layers:
                keep = mine[k_frame]
                local.append((q, q_vis, k[keep], k_frame[keep]))
            got = frame_shares(local, frames, distributed=dist.is_initialized() and world > 1)
            if rank:
                assert got is None
                continue
            want = reference_shares(layers, frames)
            results.append(
                dict(
                    layout=layout,
                    err=float((got - want).abs().max()),
                    total=float(got.sum()),
                    first=int(got.argmax()),
                    planted=planted,
                )
            )
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])  # 4: uneven shards
def test_shares_are_exact_and_find_the_planted_frame_on_every_rank_count(world):
    for row in run_ranks(_distributed_shares, world)[0]:
        assert row["err"] < 1e-6, row
        assert abs(row["total"] - 1) < 1e-9, row
        if row["planted"] is not None:
            assert row["first"] == row["planted"], row


def test_shares_in_one_process_are_exact_and_find_the_planted_frame():
    layers = _layers(5, frames=6, tokens=4, planted=2)
    got = frame_shares(layers, 6)
    assert (got - reference_shares(layers, 6)).abs().max() < 1e-6
    assert int(got.argmax()) == 2 and abs(float(got.sum()) - 1) < 1e-9


def test_queries_that_see_no_frame_count_for_nothing():
    (q, q_vis, k, k_frame), _ = _layers(3, frames=4, tokens=3)
    q_vis[:] = torch.tensor([0, 0, 4])
    both = frame_shares([(q, q_vis, k, k_frame)], 4)
    last = frame_shares([(q[2:], q_vis[2:], k, k_frame)], 4)
    assert torch.allclose(both, last, atol=1e-12)


def test_moments_merge_neighbouring_high_frames_and_rank_them():
    shares = [0.02, 0.30, 0.25, 0.03, 0.05, 0.20, 0.10]
    times = [0.0, 751.0, 760.0, 1200.0, 2000.0, 2822.0, 2823.0]
    found = moments(shares, times)
    assert found[0] == Moment(751.0, 760.0, pytest.approx(0.55))
    assert found[1] == Moment(2822.0, 2822.0, 0.20)
    assert len(found) == 2  # 0.10 is under half the top share
    assert seen_line(found) == "seen at 12:31–12:40 (55%), 47:02 (20%)"
    assert moments([0.0, 0.0], [0.0, 1.0]) == [] and seen_line([]) == ""
    with pytest.raises(ValueError):
        moments([1.0], [0.0, 1.0])


# the engine: one layout (and K/V mode, schedule) per generation, so three answers cover them all
ENGINE_CASES = {
    "g1-gateproj": dict(layout="contiguous", kv_mode="cache", xattn_schedule="auto"),
    "g1": dict(layout="striped", kv_mode="recompute", xattn_schedule="auto"),
    "g2": dict(layout="zigzag", kv_mode="cache", xattn_schedule="ring"),  # a sharded question
}
QUESTION = "what happens in the video?"


def _session(checkpoint: str, **options):
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed

    config = engine_config(checkpoint, None, dtype="float32", max_new_tokens=4, **options)
    return RankSession(config, init_distributed(cuda=False)), config


def _engine_answers(rank: int, world: int, checkpoints: dict, video: str):
    """Every rank answers one question per generation (SPMD); rank 0 returns each answer's
    tokens, per-frame shares and moments."""
    from lvx_app.engine.records import VideoRequest

    out = {}
    for generation, options in ENGINE_CASES.items():
        session, config = _session(checkpoints[generation], **options)
        session.load_video(VideoRequest.of(video, config.video))
        "".join(session.ask(QUESTION, config.generation))
        last = session.last_answer
        out[generation] = dict(
            tokens=list(last.tokens),
            new_tokens=last.new_tokens,
            shares=session.turns.last_shares,
            evidence=last.evidence,
        )
    return out if rank == 0 else None


def _one_process_reference(checkpoint: str, video: str, answer: dict) -> torch.Tensor:
    """The same answer fed in one process, its queries recorded, their softmax in float64."""
    from lvx_app.engine.evidence import EvidenceRecorder
    from lvx_app.engine.records import VideoRequest
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import DistInfo

    config = engine_config(checkpoint, None, dtype="float32", max_new_tokens=4)
    session = RankSession(config, DistInfo(0, 1, 0, torch.device("cpu"), None))
    session.load_video(VideoRequest.of(video, config.video))
    turns, conversation = session.turns, session.conversation
    turns.show_video(True)
    ids = turns.question_ids(QUESTION)
    fed = answer["tokens"][: answer["new_tokens"] - 1]
    start = conversation.position + ids.numel() - 1
    recorder = EvidenceRecorder(conversation.hooks, session.model.config, start)
    conversation.prefill(ids, whole=True, hooks=recorder.hooks)
    if fed:
        conversation.prefill(torch.tensor(fed), whole=True, hooks=recorder.hooks)
    visual = conversation.visual
    k_frame = visual.k_frame.tensor[0] if hasattr(visual.k_frame, "tensor") else visual.k_frame[0]
    layers = []
    for layer in session.model.config.cross_layer_indices:
        rows = [recorder.rows[p][layer] for p in sorted(recorder.rows)]
        q = torch.stack([r[0] for r in rows])
        q_vis = torch.stack([r[1] for r in rows])
        layers.append((q, q_vis, visual.kv[layer][0][0], k_frame))
    assert len(rows) == answer["new_tokens"]
    return reference_shares(layers, visual.num_frames)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])  # 4: uneven shards
def test_engine_shares_equal_a_float64_softmax_for_every_generation(
    world, tiny_checkpoints, short_video
):
    answers = run_ranks(_engine_answers, world, tiny_checkpoints, short_video)[0]
    for generation, answer in answers.items():
        want = _one_process_reference(tiny_checkpoints[generation], short_video, answer)
        got = torch.tensor(answer["shares"], dtype=torch.float64)
        assert (got - want).abs().max() < 1e-6, (generation, got, want)
        assert abs(float(got.sum()) - 1) < 1e-9
        top = answer["evidence"][0]  # the moment holding the largest frame share comes first
        assert float(got.max()) - 1e-12 <= top.share <= 1 + 1e-9


PLANTED_SECONDS = (1, 4)  # the red second of each video (6 s at 2 fps, sampled at 1 fps)


@pytest.fixture(scope="module")
def planted(tiny_checkpoints, tmp_path_factory):
    """({generation: checkpoint whose visual attention finds red frames}, {second: video red
    there}) (tests/planted.py)."""
    root = tmp_path_factory.mktemp("planted")
    checkpoints = {
        g: str(plant_checkpoint(source, root / f"planted-{g}"))
        for g, source in tiny_checkpoints.items()
    }
    videos = {
        s: str(make_planted_video(root / f"red-at-{s}.mp4", seconds=6, planted_second=s))
        for s in PLANTED_SECONDS
    }
    return checkpoints, videos


def _planted_answers(rank: int, world: int, checkpoints: dict, videos: dict):
    """Every rank answers one question per (generation, video); rank 0 returns each answer's
    shares, moments and the sampled frames' timestamps."""
    from lvx_app.engine.records import VideoRequest

    out = {}
    for generation, options in ENGINE_CASES.items():
        session, config = _session(checkpoints[generation], **options)
        for second, video in videos.items():
            summary = session.load_video(VideoRequest.of(video, config.video))
            "".join(session.ask(QUESTION, config.generation))
            out[generation, second] = dict(
                shares=session.turns.last_shares,
                evidence=session.last_answer.evidence,
                timestamps=list(summary.timestamps),
            )
    return out if rank == 0 else None


@pytest.mark.parametrize(
    "world",
    [1, pytest.param(4, marks=pytest.mark.slow)],  # 4: uneven shards of the 6 frames
)
def test_the_engine_finds_the_planted_frame_for_every_generation(world, planted):
    """Weights whose visual keys match the queries on red frames only, a video red for one
    second: the answer's evidence puts that frame first, at its timestamp, on every rank count,
    and moves with the red second."""
    checkpoints, videos = planted
    if world == 1:  # in this process, as `lvx.open` runs a one-rank engine
        answers = _planted_answers(0, 1, checkpoints, videos)
    else:
        answers = run_ranks(_planted_answers, world, checkpoints, videos)[0]
    assert len(answers) == len(ENGINE_CASES) * len(PLANTED_SECONDS)
    for (generation, second), answer in answers.items():
        shares, timestamps = answer["shares"], answer["timestamps"]
        assert len(shares) == len(timestamps) == 6, (generation, second, timestamps)
        red = timestamps.index(float(second))
        assert max(range(len(shares)), key=shares.__getitem__) == red, (generation, second, shares)
        assert shares[red] > 0.9 and abs(sum(shares) - 1) < 1e-9, (generation, second, shares)
        top = answer["evidence"][0]
        assert (top.start, top.end) == (float(second), float(second)), (generation, top)
        assert top.share == pytest.approx(shares[red], abs=1e-12)


def test_evidence_off_installs_nothing_and_on_fills_the_answer(tiny_checkpoints, short_video):
    """One process: on, the answer carries its moments and the shares sum to 1; off, the visual
    hook is never wrapped and the answer carries none."""
    from dataclasses import replace

    from lvx_app.engine import evidence as engine_evidence
    from lvx_app.engine.records import VideoRequest

    session, config = _session(tiny_checkpoints["g2"])
    session.load_video(VideoRequest.of(short_video, config.video))
    made = []
    real = engine_evidence.EvidenceRecorder.__init__

    def counted(self, *args):
        made.append(self)
        real(self, *args)

    engine_evidence.EvidenceRecorder.__init__ = counted
    try:
        off = replace(config.generation, evidence=False)
        "".join(session.ask(QUESTION, off))
        assert session.last_answer.evidence is None and not made
        "".join(session.ask(QUESTION, config.generation))
    finally:
        engine_evidence.EvidenceRecorder.__init__ = real
    # the answer's forwards were handed the recorder; the conversation's own hooks stay as they were
    assert len(made) == 1 and session.conversation.hooks.visual is made[0].around.visual
    assert 0 < made[0].seconds < session.last_answer.total_s  # its own time, within the answer's
    assert session.last_answer.evidence and abs(sum(session.turns.last_shares) - 1) < 1e-9


def _chat(checkpoint: str, video: str, *flags: str) -> str:
    import os
    import subprocess
    import sys

    from timing import scaled

    result = subprocess.run(
        [sys.executable, "-m", "lvx_app.cli", "chat", video, "--model", checkpoint, "--gpus", "0"]
        + ["--max-new-tokens", "4", "--no-cache", "--subtitles", "none", *flags],
        input=f"{QUESTION}\n/evidence\n/quit\n",
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_lvx_chat_prints_the_moments_under_each_answer(tiny_checkpoints, short_video):
    out = _chat(tiny_checkpoints["g2"], short_video)
    answer_and_after = out.split("lvx › ", 1)[1].splitlines()
    assert answer_and_after[1].startswith("seen at 0:0"), out  # the line under the answer
    assert "%)" in answer_and_after[1]
    listed = [line for line in out.splitlines() if line.rstrip().endswith("%")]
    assert listed, out  # /evidence: one line per moment
    quiet = _chat(tiny_checkpoints["g2"], short_video, "--no-evidence")
    assert "seen at" not in quiet and "no evidence yet" in quiet


@pytest.mark.slow
def test_lvx_chat_under_latest_frame_sees_one_moment_on_two_ranks(tiny_checkpoints, short_video):
    """`lvx chat --media-attention latest-frame` over 2 CPU ranks: the answer's `seen at` names one
    moment holding all of its attention (the last frame), and /evidence lists that one alone."""
    out = _chat(tiny_checkpoints["g2"], short_video, "--ranks", "2", "--media-attention",
                "latest-frame")  # fmt: skip
    seen = out.split("lvx › ", 1)[1].splitlines()[1]
    assert seen.startswith("seen at ") and seen.endswith("(100%)") and "," not in seen, out
    listed = [line for line in out.splitlines() if line.rstrip().endswith("%")]
    moment = seen.removeprefix("seen at ").split(" ")[0]
    assert len(listed) == 1 and listed[0].split() == [moment, "100.0%"], out


def test_the_api_returns_lvx_evidence_only_when_asked(api_here):  # noqa: F811
    """Plain OpenAI output unless the body says `"lvx_evidence": true`; then the moments come in
    the response and in the final stream chunk."""
    import json

    from test_serve_api import video_message

    client, engine, url, _ = api_here
    body = {"model": "m", "messages": [video_message(url)], "max_tokens": 3, "subtitles": "none"}
    plain = client.post("/v1/chat/completions", json=body)
    assert plain.status_code == 200 and "lvx_evidence" not in plain.json()
    assert engine.last_answer.evidence is None  # not asked: not made
    asked = client.post("/v1/chat/completions", json={**body, "lvx_evidence": True}).json()
    moments_ = asked["lvx_evidence"]
    assert moments_ and set(moments_[0]) == {"start", "end", "share"}
    assert 0 < moments_[0]["share"] <= 1 and moments_[0]["start"] <= moments_[0]["end"]
    streamed = client.post(
        "/v1/chat/completions", json={**body, "lvx_evidence": True, "stream": True}
    ).text
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.splitlines()
        if line.startswith("data: {")
    ]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["lvx_evidence"] for c in finals] == [moments_]
    assert all("lvx_evidence" not in c for c in chunks if c not in finals)


def test_the_page_shows_moments_as_thumbnails_that_seek(short_video, tmp_path):
    from lvx_ui.app import SEEK_PREFIX
    from lvx_ui.evidence_view import evidence_markdown

    found = [Moment(3.0, 5.0, 0.5), Moment(8.0, 8.0, 0.25), Moment(0.0, 0.0, 0.1), Moment(1, 1, 0)]
    text = evidence_markdown(found, short_video, SEEK_PREFIX)
    assert text.count("data:image/jpeg;base64,") == 3  # the top three, each a thumbnail
    assert f"]({SEEK_PREFIX}3.00) [0:03–0:05 (50%)]({SEEK_PREFIX}3.00)" in text
    assert f"[0:08 (25%)]({SEEK_PREFIX}8.00)" in text
    # an unreadable video still shows the moments, as links
    plain = evidence_markdown(found[:1], str(tmp_path / "gone.mp4"), SEEK_PREFIX)
    assert plain == f"seen at: [0:03–0:05 (50%)]({SEEK_PREFIX}3.00)"
    assert evidence_markdown(None, short_video, SEEK_PREFIX) == ""


def _latest_frame_answer(rank: int, world: int, checkpoint: str, video: str):
    """One answer under `--media-attention latest-frame` on a zigzag group: its shares, moments and
    the sampled frames' times (rank 0)."""
    from lvx_app.engine.records import VideoRequest

    session, config = _session(checkpoint, layout="zigzag", media_attention="latest-frame")
    summary = session.load_video(VideoRequest.of(video, config.video))
    "".join(session.ask(QUESTION, config.generation))
    last = session.last_answer
    found = dict(shares=session.turns.last_shares, evidence=last.evidence, tokens=last.tokens)
    return dict(found, times=summary.timestamps) if rank == 0 else None


def test_latest_frame_evidence_shows_only_the_last_frame(tiny_checkpoints, short_video):
    """A question after the video under `latest-frame` sees the last frame alone: its answer's
    shares are all on it, its `seen at` names its time only, the same on 1 and 2 ranks."""
    answers = [
        run_ranks(_latest_frame_answer, world, tiny_checkpoints["g2"], short_video)[0]
        for world in (1, 2)
    ]
    for answer in answers:
        *early, last = answer["shares"]
        assert early and all(s == 0 for s in early) and abs(last - 1) < 1e-9, answer["shares"]
        t = answer["times"][-1]
        assert answer["evidence"] == [Moment(t, t, pytest.approx(1.0))]
        assert seen_line(answer["evidence"]).startswith("seen at ")
    assert answers[0]["tokens"] == answers[1]["tokens"]
