"""The LV-XAttn paper's Table 3 regime, emulated row by row at scaled shapes on CPU ranks.

An emulation, not a reproduction: the paper timed whole training steps of real models on 16 A100s
(4 per node over NVLink, 25 GB/s between nodes); `bench_xattn.py --paper` times one cross-attention
call, forward and backward, of LV-XAttn and of Ring Attention (pass-KV, un-repeated K/V) on a few
CPU ranks, over `emulated_link.py`, with every ratio that decides the race kept as in the row:

- shapes: each rank holds the row's keys per query row, with as many rows as make one ring round's
  kernels about 3 GFLOP; query over K/V heads as in the model (mPLUG-Owl3-7B 28/4 → 7/1), d 64;
  bf16 queries and K/V, as the product sends them (LV-XAttn's partial outputs travel in float32);
- time: the CPU ranks' measured time of one ring round without communication (forward and backward
  of one block with its merges, all ranks computing at once) over the A100's kernel time for the
  row's real per-rank block at an assumed kernel efficiency (a fraction of 312 bf16 TFLOP/s) is the
  time scale τ; the link then runs at
  25 GB/s × (bytes per rank scaled / the row's) / τ, and each message pays NCCL's network latency ×
  τ, so transfer time over compute time is the row's on the A100s.

No mask (every query sees every key), ranks fewer than 16, one layer; the paper's Ring Attention
may have passed repeated K/V. The efficiency is an assumption: the sensitivity line repeats each row
at several, and `implied_efficiency` gives the one at which the paper's own LV-XAttn time would be
its kernel work alone (it reports LV-XAttn within 0.42% of no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from scripts.emulated_link import NCCL_NET_LATENCY_S

A100_BF16_FLOPS = 312e12  # dense bf16 peak
PAPER_LINK_BYTES_PER_S = 25e9  # between nodes, Table 3
PAPER_RANKS = 16
FWD_BWD = 3.5  # forward + backward kernel FLOPs over forward's (flash-attn: backward 2.5×)
# a training step's cross-attention work over one forward's: forward, backward, and the forward
# recomputed for backward (activation recompute on both sides)
STEP_OVER_FORWARD = 4.5
SCALED_HEAD_DIM = 64


@dataclass(frozen=True)
class PaperRow:
    """A row of the LV-XAttn paper's Table 3 (seconds per training step)."""

    model: str
    s_q: int
    frames: int
    s_kv: int
    ring_ca: float
    ring_total: float
    lv_ca: float
    lv_total: float
    ca_speedup: float
    total_speedup: float


K = 1024
R = PaperRow
# fmt: off
TABLE3 = [
    R("mPLUG-Owl3-7b", 8 * K, 4 * K, 2916 * K, 174.73, 202.84, 24.08, 42.79, 7.26, 4.74),
    R("mPLUG-Owl3-7b", 8 * K, 2 * K, 1458 * K, 89.88, 112.28, 12.14, 32.72, 7.41, 3.43),
    R("mPLUG-Owl3-7b", 4 * K, 2 * K, 1458 * K, 92.48, 107.01, 6.45, 19.5, 14.33, 5.49),
    R("mPLUG-Owl3-2b", 8 * K, 4 * K, 2916 * K, 83.41, 90.1, 10.33, 17.39, 8.07, 5.18),
    R("mPLUG-Owl3-2b", 8 * K, 2 * K, 1458 * K, 36.66, 45.42, 5.21, 11.28, 7.04, 4.03),
    R("mPLUG-Owl3-2b", 4 * K, 2 * K, 1458 * K, 37.78, 44.8, 2.79, 8.25, 13.52, 5.43),
    R("mPLUG-Owl3-1b", 8 * K, 4 * K, 2916 * K, 47.12, 55.1, 5.17, 12.69, 9.12, 4.34),
    R("mPLUG-Owl3-1b", 8 * K, 2 * K, 1458 * K, 22.63, 28.81, 2.62, 7.99, 8.64, 3.6),
    R("mPLUG-Owl3-1b", 4 * K, 2 * K, 1458 * K, 23.26, 29.24, 1.52, 5.24, 15.32, 5.58),
    R("OpenFlamingo-9b", 64 * K, 64 * K, 4096 * K, 95.13, 165.17, 62.4, 126.71, 1.52, 1.3),
    R("OpenFlamingo-9b", 64 * K, 32 * K, 2048 * K, 47.86, 101.01, 31.44, 86.89, 1.52, 1.16),
    R("OpenFlamingo-9b", 32 * K, 32 * K, 2048 * K, 33.58, 69.53, 16.0, 49.5, 2.1, 1.4),
    R("OpenFlamingo-3b", 64 * K, 64 * K, 4096 * K, 276.69, 306.51, 187.45, 226.04, 1.48, 1.36),
    R("OpenFlamingo-3b", 64 * K, 32 * K, 2048 * K, 138.05, 166.36, 94.1, 120.09, 1.47, 1.39),
    R("OpenFlamingo-3b", 32 * K, 32 * K, 2048 * K, 102.82, 118.01, 47.98, 61.57, 2.14, 1.92),
]
# model -> (query heads, K/V heads, head dim, cross-attention layers): mPLUG-Owl3's Qwen2 attention
# (lvx_models.mplug_owl3.published), OpenFlamingo's gated cross-attention (8 heads of 64)
MODELS = {
    "mPLUG-Owl3-7b": (28, 4, 128, 4),
    "mPLUG-Owl3-2b": (12, 2, 128, 4),
    "mPLUG-Owl3-1b": (14, 2, 64, 4),
    "OpenFlamingo-9b": (8, 8, 64, 8),
    "OpenFlamingo-3b": (8, 8, 64, 24),
}
# fmt: on


@dataclass(frozen=True)
class ScaledRow:
    """One rank's share of a paper row, scaled to run on a CPU rank."""

    row: PaperRow
    rows: int  # query rows per rank
    keys: int  # K/V rows per rank
    q_heads: int
    kv_heads: int
    head_dim: int
    shrink: float  # bytes each rank sends here over the row's on the A100s (Q, O, K and V alike)

    @property
    def paper_rows(self) -> int:
        return self.row.s_q // PAPER_RANKS

    @property
    def paper_keys(self) -> int:
        return self.row.s_kv // PAPER_RANKS


def scale(row: PaperRow, round_gflop: float = 3.0) -> ScaledRow:
    """The row's per-rank proportions (keys per query row) and heads' ratio at fewer heads, with
    enough rows that one round's forward and backward is about `round_gflop` GFLOP: large enough
    that the kernels, not the per-call overheads, set a round's time."""
    hq, hkv, d, _ = MODELS[row.model]
    group = hq // hkv
    kv_heads = 2 if group == 1 else 1
    per_row = FWD_BWD * 4 * (row.s_kv / row.s_q) * group * kv_heads * SCALED_HEAD_DIM
    rows = max(1, round((round_gflop * 1e9 / per_row) ** 0.5))
    keys = round(rows * row.s_kv / row.s_q)
    shrink = (rows / (row.s_q / PAPER_RANKS)) * (kv_heads / hkv) * (SCALED_HEAD_DIM / d)
    return ScaledRow(row, rows, keys, group * kv_heads, kv_heads, SCALED_HEAD_DIM, shrink)


def paper_round_s(scaled: ScaledRow, efficiency: float) -> float:
    """A100 seconds of one ring round's kernels on one rank (forward + backward of its block)."""
    hq, _, d, _ = MODELS[scaled.row.model]
    flops = FWD_BWD * 4 * scaled.paper_rows * scaled.paper_keys * hq * d
    return flops / (efficiency * A100_BF16_FLOPS)


def emulated_link_for(
    scaled: ScaledRow, efficiency: float, cpu_round_s: float
) -> tuple[float, float, float]:
    """(GB/s, latency s, time scale τ) of the link that keeps the row's transfer-to-compute ratio
    when a CPU round takes `cpu_round_s`."""
    tau = cpu_round_s / paper_round_s(scaled, efficiency)
    return PAPER_LINK_BYTES_PER_S * scaled.shrink / tau / 1e9, NCCL_NET_LATENCY_S * tau, tau


def implied_efficiency(row: PaperRow) -> float:
    """The kernel efficiency at which the paper's LV-XAttn cross-attention time is its kernel work
    alone: every CA layer's forward, backward and recomputed forward, without a mask."""
    hq, _, d, layers = MODELS[row.model]
    flops = STEP_OVER_FORWARD * layers * 4 * row.s_q * row.s_kv * hq * d / PAPER_RANKS
    return flops / row.lv_ca / A100_BF16_FLOPS
