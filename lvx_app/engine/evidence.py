"""Where in the video an answer looked, recorded while it is generated (every rank, in step).

`EvidenceRecorder` wraps the conversation's visual attention hook for one answer (the forwards of
that answer are handed its `hooks`; nothing is set on the model or the conversation): each cross
layer's call hands it the queries (roped, as the kernel sees them) and their visible-frame counts,
and it copies the rows at the answer's positions, nothing else (a decoded token's is one row per
layer: one copy of its queries and one of its count; sorting them by position waits for the
answer's end). The positions are those whose logits produced the answer's tokens: the last prompt
token and every fed answer token but the last (a token fed and taken back, or fed again after the
ranks disagreed, leaves the row of its position as last fed). The answer's end (`answer_shares`)
turns them into each frame's share of the visual attention (lvx_app/attention/frame_shares.py),
against this rank's keys (resident, or recomputed in `--kv-mode recompute`), merged exactly over
the group.

Off (`--no-evidence`), or on the static decode step (whose captured or compiled step runs no
Python per token), no recorder is made and nothing extra runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lvx_app.attention.frame_shares import frame_shares
from lvx_app.engine.moments import moments
from lvx_app.engine.records import Moment
from lvx_kernels.masks import device_tensor
from lvx_models.api import AttentionHooks, ModelConfig


class EvidenceRecorder:
    """The visual hook of one answer's forwards (`hooks`: `around`'s text hook and this), keeping
    the queries of positions `start` and later. Per call it only copies the call's query rows and
    their visible-frame counts (one copy each); `rows` sorts them by position at the answer's end:
    {position: {layer: (q (Hq, D), q_vis ())}}, a later call's row of a position replacing an
    earlier one. `config`: the model's (its query heads and head size). `seconds`: the time this
    rank spent on the answer's evidence (recording, and `answer_shares` at its end), what a
    benchmark sets against the answer's decode time."""

    def __init__(self, around: AttentionHooks, config: ModelConfig, start: int) -> None:
        self.config, self.start = config, start
        self.around = around
        self.calls: list[tuple[int, list[int], torch.Tensor, torch.Tensor]] = []
        self.seconds = 0.0
        self._rows: tuple[int, dict] = (0, {})

    def __call__(self, q: torch.Tensor, step, layer: int):
        t0 = time.perf_counter()
        positions = _positions(q, step, layer)
        keep = [i for i, position in enumerate(positions) if position >= self.start]
        if keep:
            q_vis = device_tensor(step.visual.q_vis)[0]
            if len(keep) == len(positions):
                rows, q_vis = q[0].clone(), q_vis.clone()
            else:
                index = torch.tensor(keep, device=q.device)
                rows, q_vis = q[0].index_select(0, index), q_vis.index_select(0, index)
            self.calls.append((layer, [positions[i] for i in keep], rows, q_vis))
        self.seconds += time.perf_counter() - t0
        return self.around.visual(q, step, layer)

    @property
    def hooks(self) -> AttentionHooks:
        """The answer's hooks, made when asked: held on the recorder they would hold it in a cycle,
        and its tensors would wait for the cycle collector's rare full pass instead of going with
        the answer."""
        return AttentionHooks(text=self.around.text, visual=self)

    @property
    def rows(self) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        made, rows = self._rows
        if made != len(self.calls):
            rows = {}
            for layer, positions, q, q_vis in self.calls:
                for i, position in enumerate(positions):
                    rows.setdefault(position, {})[layer] = (q[i], q_vis[i])
            self._rows = (len(self.calls), rows)
        return rows


def _positions(q: torch.Tensor, step, layer: int) -> list[int]:
    """The global position of each of the forward's query rows on this rank."""
    feed = step.feed
    if feed.replicated:  # the tokens follow what the cache held before this forward
        start = _held_before(step.cache, layer, q.shape[1])
        return list(range(start, start + q.shape[1]))
    return (feed.text_q_vis.values.view(-1) - 1).tolist()


def _held_before(cache, layer: int, rows: int) -> int:
    """The cache's length before the forward now running: every layer takes its `rows` once, in
    order, and a layer that attends to the frames may do so after its own text update (mPLUG-Owl3,
    Llama-3.2-Vision) or before it (OpenFlamingo's cross layer runs before its block). Mid-forward
    the layers not yet run are the shortest; with every layer alike, the forward is before the
    first layer's update, or past the last one's."""
    lengths = [l.length for l in cache.layers]
    low = min(lengths)
    if low < max(lengths) or layer < len(lengths) - 1:
        return low
    return low - rows


def answer_shares(
    recorder: EvidenceRecorder,
    visual,
    layers: Sequence[int],
    tokens: int,
    sharded_prefill: bool,
    world: int,
) -> torch.Tensor | None:
    """Each frame's share of the answer's visual attention, (frames,) float64 on rank 0 (None
    elsewhere, and for an answer of no tokens). Every rank calls it alike. `tokens`: the answer's
    tokens, so positions start .. start + tokens - 1 produced them; `sharded_prefill`: the last
    prompt token's row is on one rank only and is summed over the group first."""
    positions = range(recorder.start, recorder.start + tokens)
    if not tokens or not layers:
        return None
    t0 = time.perf_counter()
    first = _first_rows(recorder, visual, layers, sharded_prefill and world > 1)
    parts, held = [], recorder.rows
    k_frame = device_tensor(visual.k_frame)[0]
    for i, layer in enumerate(layers):
        rows = [first[i] if p == recorder.start else held[p][layer] for p in positions]
        q = torch.stack([r[0] for r in rows])
        q_vis = torch.stack([r[1].to(q.device) for r in rows])
        k, _ = visual.kv[layer]
        parts.append((q, q_vis, k[0], k_frame))
    shares = frame_shares(parts, visual.num_frames, distributed=world > 1, window=visual.window)
    recorder.seconds += time.perf_counter() - t0
    return shares


def _first_rows(recorder: EvidenceRecorder, visual, layers: Sequence[int], summed: bool):
    """The last prompt token's row per layer; on a sharded prefill it is on one rank only and
    reaches every rank through one all_reduce (the others add exact zeros): per layer the query's
    values and, last, its visible-frame count, in float64 (both exact there)."""
    held = recorder.rows.get(recorder.start)
    if not summed:
        return [held[layer] for layer in layers]
    config = recorder.config
    k = visual.kv[layers[0]][0]
    dtype = torch.promote_types(k.dtype, torch.float32)
    heads, dim = config.cross_attention_heads, config.cross_head_dim
    rows = torch.zeros(len(layers), heads * dim + 1, dtype=torch.float64, device=k.device)
    if held is not None:
        rows[:, :-1] = torch.stack([held[layer][0].reshape(-1) for layer in layers])
        rows[:, -1] = torch.stack([held[layer][1].to(k.device) for layer in layers])
    dist.all_reduce(rows)
    q = rows[:, :-1].to(dtype).view(len(layers), heads, dim)
    q_vis = rows[:, -1].to(torch.int64)
    return [(q[i], q_vis[i]) for i in range(len(layers))]


def answer_moments(shares: torch.Tensor | None, timestamps: Sequence[float]) -> list[Moment]:
    """The moments of rank 0's shares at the sampled frames' timestamps."""
    return [] if shares is None else moments(shares.tolist(), timestamps)
