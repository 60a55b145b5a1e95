"""Llama-3.2-Vision through the engine that runs mPLUG-Owl3: the model surface the engine calls
gives the logits of `MllamaModel`'s parity-tested forward for a video prompt, and a chat over two
gloo ranks answers with the tokens of one process and says where in the video it looked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_configs import engine_config
from videos import make_video

from lvx_app.engine.header_prefill import HeaderAttention
from lvx_models.api import VIDEO, AttentionHooks, family_of
from lvx_models.mllama.tiny import write_tiny_checkpoint
from scripts.gloo_ranks import run_ranks

QUESTION = "what happens first in the video"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("mllama")))


def test_surface_equals_the_parity_forward(checkpoint):
    """Frames prepared as the app prepares them, encoded (with the published empty tiles), their
    K/V made per cross layer and the prompt fed as the engine feeds it give `MllamaModel`'s
    logits (float64) on the processor's padded frames: the rows before the frames attend to every
    tile's keys (`HeaderAttention`: the resident K/V, then the empty tiles' one frame at a time,
    merged), the rest to the resident K/V."""
    model, _, processor = family_of(checkpoint).load(checkpoint, dtype=torch.float64)
    frames = np.random.default_rng(1).integers(0, 256, (3, 30, 50, 3), dtype=np.uint8)
    ref = processor.video(list(frames), QUESTION)
    with torch.no_grad():
        want = model.mllama(ref.input_ids, **ref.model_inputs())
    prompt = processor.build_chat_prompt(
        [{"role": "user", "content": VIDEO + QUESTION}], videos=[len(frames)]
    )
    assert prompt.input_ids.tolist() == ref.input_ids[0].tolist()
    pixels = processor.frame_prep.pixel_values(frames)
    assert torch.equal(pixels, ref.pixel_values[0, :, 0])
    encoded = model.encode_frames(pixels)
    assert torch.equal(encoded.features, model.encode_images(pixels))
    assert encoded.header_features.shape[1] == 3 * encoded.features.shape[1]  # the empty tiles
    visual = model.prepare_visual(encoded.features, torch.tensor(prompt.media_starts))
    header = HeaderAttention(model, visual.kv, encoded.header_features, torch.device("cpu"))
    header.chunk = 1
    cache, ids, first = model.new_cache(), prompt.input_ids[None], prompt.media_starts[0]
    with torch.no_grad():  # the rows before the frames, then the rest
        got = torch.cat([model(ids[:, :first], cache=cache, visual=visual,
                               hooks=AttentionHooks(visual=header)),
                         model(ids[:, first:], cache=cache, visual=visual)], dim=1)  # fmt: skip
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_followups_continue_the_template(checkpoint):
    """A follow-up after an answer closed with `<|eot_id|>` is the template's next user turn."""
    _, _, processor = family_of(checkpoint).load(checkpoint, dtype=torch.float32)
    turns = [{"role": "user", "content": VIDEO + "a"}]
    first = processor.build_chat_prompt(turns, videos=[2]).input_ids.tolist()
    follow = processor.build_followup("b", offset=len(first) + 2).input_ids.tolist()
    whole = processor.build_chat_prompt(
        turns + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}],
        videos=[2],
    ).input_ids.tolist()
    answer = processor.encode_text("x") + [processor.stop_ids[0]]
    assert first + answer + follow == whole
    assert processor.encode_text("<|eot_id|>") != [processor.stop_ids[0]]  # typed: plain text


def _answer(rank: int, world: int, checkpoint: str, video: str):
    """Every rank loads the video and answers two turns; rank 0 returns the tokens and shares."""
    from lvx_app.engine.records import VideoRequest
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import DistInfo, init_distributed

    config = engine_config(checkpoint, None, dtype="float32", max_new_tokens=5)
    info = (
        init_distributed(cuda=False) if world > 1 else DistInfo(0, 1, 0, torch.device("cpu"), None)
    )
    session = RankSession(config, info)
    session.load_video(VideoRequest.of(video, config.video))
    out = []
    for question in (QUESTION, "and then"):
        text = "".join(session.ask(question, config.generation))
        last = session.last_answer
        out.append((text, list(last.tokens), session.turns.last_shares, last.evidence))
    return out if rank == 0 else None


@pytest.mark.slow
def test_two_ranks_answer_as_one_with_evidence(checkpoint, tmp_path):
    video = str(make_video(tmp_path / "v.mp4", 12, fps=2, width=64, height=48))
    one = _answer(0, 1, checkpoint, video)
    two = run_ranks(_answer, 2, checkpoint, video)[0]
    for (text, tokens, shares, evidence), (text2, tokens2, shares2, evidence2) in zip(one, two):
        assert tokens and tokens2 == tokens and text2 == text
        assert len(shares) == 6 and abs(sum(shares) - 1) < 1e-9
        assert np.allclose(shares2, shares, rtol=0, atol=1e-6)
        assert evidence and [(m.start, m.end) for m in evidence2] == [
            (m.start, m.end) for m in evidence
        ]
