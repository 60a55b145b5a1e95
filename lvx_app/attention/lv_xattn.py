"""LV-XAttn: exact distributed cross-attention that moves queries, never keys.

Each of n ranks holds its own visual K/V shard (any length, may be empty; it
never leaves the rank) and its own slice of the text queries (any length, may
be empty; the lengths are exchanged with one tiny all_gather per forward,
reused by the backward, or passed in as `q_sizes`). All ranks must agree on
batch, query heads, head_dim, dtype, scale and whether a media mask is used.
Query block j starts on rank j and walks the ring r -> r+1:

forward, round t on rank r (it holds block j = r - t):
  1. post the P2P that passes Q_j (+ its q_vis row) on to r+1 and receives
     Q_{j-1} for the next round (t < n-1);
  2. compute the partial (o, lse) of Q_j against the local K/V (fully hidden
     tiles and empty shards are skipped inside `attn_fwd`);
  3. wait for the running (O_j, lse_j) that rank r-1 merged last round, merge
     the partial into it (log-sum-exp, float32);
  4. post the P2P that passes (O_j, lse_j) on (packed in one float32 buffer).
After n rounds every block has seen every shard and its (O, lse) is home:
n-1 Q transfers and n (O, lse) transfers per rank, no K/V transfer. Bytes
sent by rank r, with S_j the length of block j held in round t:
  forward  sum_{t<n-1} S_j*B*(Hq*D*esize + 4*[mask]) + sum_t S_j*B*Hq*(D+1)*4
  backward sum_{t<n-1} S_j*B*(3*Hq*D*esize + n_l*Hq*4 + 4*[mask]) + sum_t S_j*B*Hq*D*4
(n_l = 2 with lse, 1 for `lv_xattn`); pass `stats={}` to get them added up as fwd_bytes / bwd_bytes.
Empty blocks are never sent (one-sided P2P instead of padding).

backward: the same ring with (Q_j, dO_j, O_j) [one packed q-dtype message],
(lse_j[, dlse_j]) [one float32 message] and q_vis_j travelling, the dQ_j
accumulator (float32) passed on after each round; dK, dV accumulate locally
(float32) and are exact because every block backward uses the final (O, lse).

On CUDA the P2P is posted on a side stream that first waits for the producer
stream; `wait` makes the compute stream wait for it. (Untested without a GPU.)
Float64 inputs keep O/lse in float64 (exact tests); otherwise they travel in
float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lvx_app.attention.kernels import attn_bwd, attn_fwd, augment_kv, check_inputs
from lvx_app.attention.merge import acc_dtype, merge_
from lvx_app.parallel import RingComm, get_world_size
from lvx_app.parallel.collectives import count_bytes, exchange_sizes


class _Ring(RingComm):
    """RingComm that also does one-sided transfers (uneven or empty blocks) and a CUDA side stream."""

    def __init__(self, group, device: torch.device) -> None:
        super().__init__(group)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.world_size > 1 else None

    def post(self, pairs) -> None:
        """pairs: [(send tensor or None, recv buffer or None)]; queue all, then commit.

        Empty tensors are skipped on both sides (both know every block's length)."""
        for send, recv in pairs:
            if send is not None and send.numel():
                send = send.contiguous()
                self._ops.append(dist.P2POp(dist.isend, send, self.send_to, self.group))
                self.bytes_sent += send.numel() * send.element_size()
            if recv is not None and recv.numel():
                self._ops.append(dist.P2POp(dist.irecv, recv, self.recv_from, self.group))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self.commit()
        else:
            self.commit()

    def wait(self) -> None:
        super().wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def _query_sizes(q: torch.Tensor, group, n: int, rank: int, known=None) -> list[int]:
    """Every rank's query-block length: `known` (checked) or one all_gather of one int."""
    if known is not None:
        known = [int(x) for x in known]
        if len(known) != n or known[rank] != q.shape[1]:
            raise ValueError(f"q_sizes {known} must list {n} block lengths with q_sizes[{rank}] == {q.shape[1]}")
        return known
    (sizes,) = exchange_sizes(q.shape[1], group=group, device=q.device)
    return sizes


def _split_ol(buf: torch.Tensor, b: int, s: int, h: int, d: int):
    n1 = b * s * h * d
    return buf[:n1].view(b, s, h, d), buf[n1:].view(b, h, s)


def _forward(q, k, v, scale, q_vis, k_frame, group, q_sizes):
    """Returns (out in q dtype, lse float32, per-rank query sizes, bytes sent by this rank)."""
    n = get_world_size(group)
    b, sq, hq, d = q.shape
    qring, oring = _Ring(group, q.device), _Ring(group, q.device)
    r = qring.rank
    sizes = _query_sizes(q, group, n, r, q_sizes)
    ct = acc_dtype(q)
    media = q_vis is not None
    qv = q_vis.to(torch.int32).contiguous() if media else None

    def ol_buf(s):
        return torch.empty(b * s * hq * (d + 1), dtype=ct, device=q.device)

    cur_q, cur_qv, ol = q, qv, None  # ol: packed running (O, lse) of the held block
    for t in range(n):
        j = (r - t) % n
        sj, sp = sizes[j], sizes[(j - 1) % n]
        if t < n - 1:  # 1. pass the held query block on, receive the next round's
            nxt_q = q.new_empty(b, sp, hq, d)
            nxt_qv = qv.new_empty(b, sp) if media else None
            qring.post([(cur_q, nxt_q), (cur_qv, nxt_qv)])
        if sj:  # 2. partial result against the local shard (overlaps the transfers)
            o, l_ = attn_fwd(cur_q, k, v, scale=scale, q_vis=cur_qv, k_frame=k_frame)
        if t > 0:  # 3. the running (O, lse) rank r-1 passed on last round
            oring.wait()
        if sj:
            if t == 0:
                ol = ol_buf(sj)
                O, L = _split_ol(ol, b, sj, hq, d)
                O.copy_(o)
                L.copy_(l_)
            else:
                merge_(*_split_ol(ol, b, sj, hq, d), o, l_)
        if n == 1:
            break
        nxt_ol = ol_buf(sp)  # 4. pass (O, lse) on; the last round's send brings every block home
        oring.post([(ol, nxt_ol)])
        if t < n - 1:
            qring.wait()
            cur_q, cur_qv = nxt_q, nxt_qv
        ol = nxt_ol
    if n > 1:
        oring.wait()
    sent = qring.bytes_sent + oring.bytes_sent
    if sq == 0:
        return q.new_zeros(b, 0, hq, d), torch.empty(b, hq, 0, dtype=ct, device=q.device), sizes, sent
    O, L = _split_ol(ol, b, sq, hq, d)
    return O.to(q.dtype), L, sizes, sent


def _backward(dout, dlse, q, k, v, out, lse, scale, q_vis, k_frame, group, with_lse, sizes):
    """Returns (dq, dk, dv, bytes sent). `with_lse`: carry dlse (zeros where None) on every rank."""
    n = get_world_size(group)
    b, sq, hq, d = q.shape
    qring, gring = _Ring(group, q.device), _Ring(group, q.device)
    r = qring.rank
    ct = acc_dtype(q)
    media = q_vis is not None
    nl = 2 if with_lse else 1
    dk = torch.zeros(k.shape, dtype=acc_dtype(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype(v), device=v.device)
    # dlse rides through the aten backward ops as extra K/V columns: build them once, not per round
    kv_aug = augment_kv(k, v) if with_lse and k.shape[1] and k.dtype != torch.float64 else None

    # the static part of a block: (Q, dO, O) in q's dtype, (lse[, dlse]) in float32, q_vis
    cur_x = torch.stack([q, dout.to(q.dtype), out.to(q.dtype)])
    cur_l = torch.empty(nl, b, hq, sq, dtype=ct, device=q.device)
    cur_l[0] = lse
    if with_lse:
        cur_l[1] = 0 if dlse is None else dlse
    cur_qv = q_vis.to(torch.int32).contiguous() if media else None
    dq_acc = None
    for t in range(n):
        j = (r - t) % n
        sj, sp = sizes[j], sizes[(j - 1) % n]
        if t < n - 1:
            nxt_x = q.new_empty(3, b, sp, hq, d)
            nxt_l = cur_l.new_empty(nl, b, hq, sp)
            nxt_qv = cur_qv.new_empty(b, sp) if media else None
            qring.post([(cur_x, nxt_x), (cur_l, nxt_l), (cur_qv, nxt_qv)])
        if sj:
            gq, gk, gv = attn_bwd(
                cur_x[1], cur_x[0], k, v, cur_x[2], cur_l[0], scale=scale, q_vis=cur_qv, k_frame=k_frame,
                dlse=cur_l[1] if with_lse else None, kv_aug=kv_aug,
            )
            dk += gk
            dv += gv
        if t > 0:
            gring.wait()
        if sj:
            if t == 0:
                dq_acc = gq.to(ct)
            else:
                dq_acc += gq
        if n == 1:
            break
        nxt_dq = torch.empty(b, sp, hq, d, dtype=ct, device=q.device)
        gring.post([(dq_acc, nxt_dq)])
        if t < n - 1:
            qring.wait()
            cur_x, cur_l, cur_qv = nxt_x, nxt_l, nxt_qv
        dq_acc = nxt_dq
    if n > 1:
        gring.wait()
    sent = qring.bytes_sent + gring.bytes_sent
    dq = torch.zeros_like(q) if dq_acc is None or sq == 0 else dq_acc.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), sent


class _LVXAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, q_vis, k_frame, group, with_lse, q_sizes, stats):
        out, lse, sizes, sent = _forward(q, k, v, scale, q_vis, k_frame, group, q_sizes)
        count_bytes(stats, "fwd_bytes", sent)
        ctx.stats = stats
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, q_vis, k_frame, group, with_lse, sizes)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, q_vis, k_frame, group, with_lse, sizes = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, sent = _backward(dout, dlse, q, k, v, out, lse, scale, q_vis, k_frame, group, with_lse, sizes)
        count_bytes(ctx.stats, "bwd_bytes", sent)
        return dq, dk, dv, None, None, None, None, None, None, None


def lv_xattn_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: torch.Tensor | None = None,
    k_frame: torch.Tensor | None = None,
    q_sizes: list[int] | None = None,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LV-XAttn over the ranks of `group`; returns this rank's (out (B,Sq,Hq,D) q dtype, lse (B,Hq,Sq) float32).

    q: this rank's query block (B, Sq_r, Hq, D), any length incl. 0; k, v: this
    rank's K/V shard (B, Sk_r, Hkv, D), any length incl. 0, never sent. q_vis
    (B, Sq_r) and k_frame (B, Sk_r): the media mask (see kernels). `scale`
    defaults to 1/sqrt(D) and must match on all ranks, as must B, Hq, D and
    the dtype. `q_sizes`: every rank's query-block length in group-rank order,
    if the caller knows it (skips the one all_gather of sizes per call).
    `stats`: a dict to which the bytes this rank sends are added (fwd_bytes, bwd_bytes).
    Differentiable through both outputs (the backward always carries dlse
    around the ring, zeros where the loss does not use lse).
    """
    check_inputs(q, k, v, q_vis, k_frame)
    return _LVXAttn.apply(q, k, v, scale, q_vis, k_frame, group, True, q_sizes, stats)


def lv_xattn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    q_vis: torch.Tensor | None = None,
    k_frame: torch.Tensor | None = None,
    q_sizes: list[int] | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """LV-XAttn, output only (the backward ring carries no dlse); see `lv_xattn_with_lse`."""
    check_inputs(q, k, v, q_vis, k_frame)
    return _LVXAttn.apply(q, k, v, scale, q_vis, k_frame, group, False, q_sizes, stats)[0]
