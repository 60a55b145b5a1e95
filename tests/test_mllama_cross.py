"""Mllama's cross-attention under the processor's mask equals a dense float64 softmax with the
published masking (rows that see nothing attend to every key), whether it runs as one media-masked
call (a prefix of units per row) or per set of units (images between text). A rank's share of the
units is covered end to end by test_mllama_distributed.py."""

from __future__ import annotations

import pytest
import torch

from lvx_models.mllama.cross import CrossVisibility, local_cross_attn
from lvx_models.mllama.processor import image_spans

P, HQ, HKV, D = 3, 4, 2, 8


def _token_mask(ids: list[int], tiles: list[int], max_tiles: int) -> torch.Tensor:
    """(L, images, max_tiles) as the processor builds it (image id 9)."""
    mask = torch.zeros(len(ids), len(tiles), max_tiles, dtype=torch.int64)
    for i, (a, b) in enumerate(image_spans(ids, 9)):
        mask[a:b, i, : tiles[i]] = 1
    return mask


def _dense(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """The published eager attention: additive mask, rows with nothing visible left unmasked."""
    allowed = mask.flatten(1).bool().repeat_interleave(P, dim=1)  # (L, S_kv)
    allowed = allowed | ~allowed.any(dim=1, keepdim=True)
    kk = k.repeat_interleave(HQ // HKV, dim=2)
    vv = v.repeat_interleave(HQ // HKV, dim=2)
    s = torch.einsum("blhd,bshd->bhls", q, kk) / D**0.5
    s = s.masked_fill(~allowed[None, None], float("-inf"))
    return torch.einsum("bhls,bshd->blhd", s.softmax(-1), vv)


CASES = {
    # a video: consecutive images, every tile real (one prefix for every row)
    "frames": ([1, 2, 9, 9, 9, 3, 4, 5], [1, 1, 1], 1),
    # one image with empty tiles: the first rows see the empty tiles too
    "empty tiles": ([1, 2, 9, 3, 4], [2], 4),
    # images between text: the second span does not start at image 0 (not a prefix)
    "between text": ([1, 9, 3, 4, 9, 5, 6], [3, 1], 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(case):
    ids, tiles, max_tiles = CASES[case]
    mask = _token_mask(ids, tiles, max_tiles)
    g = torch.Generator().manual_seed(0)
    units = mask.shape[1] * mask.shape[2]
    q = torch.randn(1, len(ids), HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, units * P, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, units * P, HKV, D, generator=g, dtype=torch.float64)
    vis = CrossVisibility.from_token_mask(mask, P)
    assert (vis.media_mask is None) == (case == "between text")
    got = local_cross_attn(q, k, v, vis, layer=0)
    torch.testing.assert_close(got, _dense(q, k, v, mask), rtol=1e-12, atol=1e-12)
