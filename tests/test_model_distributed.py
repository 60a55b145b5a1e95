"""The model with its frames split over gloo ranks (LV-XAttn for the visual attention) gives the
same logits and the same greedy tokens as one process.

Each rank holds a contiguous slice of the frames (an empty slice included) and only their visual
K/V; the text queries are replicated on every rank and passed whole to `lv_xattn_with_lse` (prefill)
or `decode_xattn` (one-token steps). The model itself never imports torch.distributed: its forward
is handed hooks whose visual attention is the distributed one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_generation_cache import generate
from test_hyper_attention import P, tiny_config, tiny_model

from lvx_models.steps import AttentionHooks
from scripts.gloo_ranks import run_ranks

# the three checkpoint generations, each in the same ranks (no extra spawn)
FORMS = ("g1-gateproj", "g1", "g2")


def _inputs(generation: str, n_frames: int):
    cfg = tiny_config(generation)
    model = tiny_model(cfg)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 22), generator=g)
    starts = torch.arange(n_frames) * 4 + 2  # placeholders at 2, 6, 10, ...
    E = torch.randn(n_frames, P, cfg.hidden_size, generator=g, dtype=torch.float64)
    return model, ids, starts, E


def _distributed_visual(q, step, layer):
    from lvx_app.attention import decode_xattn, lv_xattn_with_lse

    vis = step.visual
    k, v = vis.kv[layer]
    fn = decode_xattn if q.shape[1] == 1 else lv_xattn_with_lse
    return fn(q, k, v, q_vis=vis.q_vis, k_frame=vis.k_frame, window=vis.window)


def _run(rank: int, world: int, n_frames: int, window: int | None = None):
    out = {}
    for generation in FORMS:
        model, ids, starts, E = _inputs(generation, n_frames)
        mine = torch.tensor_split(torch.arange(n_frames), world)[rank]  # contiguous, possibly empty
        hooks = AttentionHooks(visual=_distributed_visual)
        visual = model.prepare_visual(E[mine], starts, frame_ids=mine)
        visual = replace(visual, window=window)
        with torch.no_grad():
            logits = model(ids, visual=visual, hooks=hooks)
            tokens = generate(model, ids, visual=visual, max_new_tokens=4, hooks=hooks)
        # numpy, not a tensor: torch sends tensors through a queue as shared-memory handles that die
        # with the rank
        out[generation] = (mine.numel(), logits.numpy(), tokens)
    return out


@pytest.mark.parametrize(
    "world,n_frames,window", [(2, 4, None), (3, 4, None), (3, 2, None), (2, 5, 1), (3, 4, 1)]
)
def test_frames_split_over_ranks_match_one_process(world, n_frames, window):
    """Every frame before a token, or the latest alone (`--media-attention latest-frame`, window
    1), on uneven shards: float64 logits and greedy tokens as one process."""
    results = run_ranks(_run, world, n_frames, window)
    for generation in FORMS:
        model, ids, starts, E = _inputs(generation, n_frames)
        visual = replace(model.prepare_visual(E, starts), window=window)
        with torch.no_grad():
            want = model(ids, visual=visual)
            want_tokens = generate(model, ids, visual=visual, max_new_tokens=4)
        assert sum(r[generation][0] for r in results) == n_frames
        for rank, r in enumerate(results):
            n, logits, tokens = r[generation]
            torch.testing.assert_close(
                torch.from_numpy(logits),
                want,
                rtol=1e-10,
                atol=1e-10,
                msg=lambda m: f"{generation} rank {rank}: {m}",
            )
            assert tokens == want_tokens, f"{generation} rank {rank}"


def test_the_latest_frame_changes_what_a_token_sees_and_only_that():
    """Window 1: in the first hyper layer (its queries made before any frame is seen), a token after
    the last placeholder attends to the last frame alone (changing frame 0 leaves its output as
    it was; by default it changes), and a token before the second placeholder sees the same
    under both."""
    from lvx_models.steps import default_visual_attn

    model, ids, starts, E = _inputs("g2", 4)
    other = E.clone()
    other[0] += 1.0  # frame 0 changed
    first = model.config.cross_layer_indices[0]
    outs = {}
    for window in (None, 1):
        for name, features in (("E", E), ("other", other)):

            def record(q, step, layer, key=(window, name)):
                out, lse = default_visual_attn(q, step, layer)
                outs.setdefault(key, out) if layer == first else None
                return out, lse

            visual = replace(model.prepare_visual(features, starts), window=window)
            with torch.no_grad():
                model(ids, visual=visual, hooks=AttentionHooks(visual=record))
    last, early = slice(int(starts[-1]) + 1, None), slice(0, int(starts[1]))
    assert torch.equal(outs[1, "E"][:, last], outs[1, "other"][:, last])
    assert not torch.allclose(outs[None, "E"][:, last], outs[None, "other"][:, last])
    torch.testing.assert_close(outs[1, "E"][:, early], outs[None, "E"][:, early])
    assert not torch.allclose(outs[1, "E"][:, last], outs[None, "E"][:, last])
