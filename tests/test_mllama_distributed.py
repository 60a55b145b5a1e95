"""Llama-3.2-Vision with a video's frames split over gloo ranks (LV-XAttn for the cross-attention)
gives the same logits and greedy tokens as one process.

Each rank encodes only its frames (a contiguous share, an empty one included) and keeps only their
visual K/V; the text is replicated, each rank passes its own slice of the query rows around the
ring (`lv_xattn_with_lse`, under the media mask the visibility gives) and the slices are gathered
back; a decoded token goes through `decode_xattn`. The model never imports torch.distributed: the
cross-attention is a callable it is handed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lvx_models.mllama.cross import CrossVisibility
from lvx_models.mllama.loader import load_mllama
from lvx_models.mllama.processor import chat_prompt
from lvx_models.mllama.tiny import write_tiny_checkpoint
from scripts.gloo_ranks import run_ranks

FRAMES = 4


def _video(processor, tiles: int):
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (30, 50, 3), dtype=np.uint8) for _ in range(FRAMES)]
    return processor(chat_prompt("what happens in the video", FRAMES), frames, max_tiles=tiles)


def sharded_cross_attn(q, k, v, vis: CrossVisibility, layer: int):
    """This rank's query rows around the ring against every rank's K/V, the rows gathered back."""
    import torch.distributed as dist

    from lvx_app.attention import decode_xattn, lv_xattn_with_lse

    q_vis, k_frame = vis.media_mask
    if q.shape[1] == 1:
        return decode_xattn(q, k, v, q_vis=q_vis, k_frame=k_frame)[0]
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.tensor_split(torch.arange(q.shape[1]), world)
    mine = rows[rank]
    out, _ = lv_xattn_with_lse(
        q[:, mine].contiguous(),
        k,
        v,
        q_vis=q_vis[:, mine],
        k_frame=k_frame,
        q_sizes=[len(r) for r in rows],
    )
    most = len(rows[0])  # gloo gathers equal sizes: the shorter slices travel padded
    sent = out.new_zeros(1, most, *q.shape[2:])
    sent[:, : len(mine)] = out
    parts = [torch.empty_like(sent) for _ in rows]
    dist.all_gather(parts, sent)
    return torch.cat([p[:, : len(r)] for p, r in zip(parts, rows)], dim=1)


TILES = (1, 4)  # one tile a frame (lvx's video default), or as many as the published images get


def _shard(model, cfg, inputs, mine: torch.Tensor):
    """The visual K/V of this rank's frames and the forward's visibility over them."""
    t = inputs.pixel_values.shape[2]
    features = model.visual_features(
        inputs.pixel_values[0, mine],
        inputs.aspect_ratio_ids[0, mine],
        inputs.aspect_ratio_mask[0, mine],
    )
    units = (mine[:, None] * t + torch.arange(t)).flatten()
    mask = inputs.cross_attention_mask[0]
    return model.visual_kv(features), CrossVisibility.from_token_mask(
        mask, cfg.vision.patches_per_tile, units
    )


def _run(rank: int, world: int, directory: str):
    model, processor, cfg = load_mllama(directory, torch.float64)
    mine = torch.tensor_split(torch.arange(FRAMES), world)[rank]  # contiguous
    out = {}
    for tiles in TILES:  # both in the same ranks (no extra spawn)
        inputs = _video(processor, tiles)
        with torch.no_grad():
            visual = _shard(model, cfg, inputs, mine)
            logits = model(inputs.input_ids, visual=visual, cross_attn=sharded_cross_attn)
            tokens = model.greedy(inputs.input_ids, 5, visual=visual, cross_attn=sharded_cross_attn)
        out[tiles] = (mine.numel(), logits.numpy(), tokens)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_frames_split_over_ranks_match_one_process(tmp_path, world):
    d = write_tiny_checkpoint(tmp_path)
    results = run_ranks(_run, world, str(d))
    model, processor, _ = load_mllama(d, torch.float64)
    for tiles in TILES:
        inputs = _video(processor, tiles)
        with torch.no_grad():
            want = model(inputs.input_ids, **inputs.model_inputs())
            want_tokens = model.greedy(inputs.input_ids, 5, **inputs.model_inputs())
        assert sum(r[tiles][0] for r in results) == FRAMES
        for rank, r in enumerate(results):
            _, logits, tokens = r[tiles]
            torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-10, atol=1e-10)
            assert tokens == want_tokens, f"{tiles} tiles, rank {rank}"
