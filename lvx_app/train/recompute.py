"""Training attention for mPLUG-Owl3 over sharded text and sharded frames: the LV-XAttn recompute
scheme.

Why this module exists: `lv_xattn_with_lse` is an autograd Function that saves its K/V. Fed with K/V
made from the projector output E (even lazily, `prepare_visual(precompute=False)`), autograd then
keeps per hyper layer the visual K/V *and* everything `v_kv_proj(RMSNorm(E))` saved for its own
backward (the normalised E, the fp32 RoPE temporaries). With S_kv in the millions that is most of
the training memory. The LV-XAttn paper's scheme keeps ONE copy of E per rank, shared by all hyper
layers, saves only (q, O, lse) per layer and remakes K_i, V_i = proj_l(E_i) in the backward.
`_RecomputeXAttn` does exactly that, and unlike the authors' prototype (reference
distributed_attention.md §1.4) it pushes dK/dV back through the projection, so v_kv_proj, the layer
norm weight, LoRA adapters and E itself (when the projector trains) get their gradients.

Pieces:
- `TrainAttention`: the `AttentionHooks` the model calls, the sharded hooks inference uses too
  (lvx_app/engine/parallelize.py: `ShardedHooks`). Text self-attention is sharded causal attention
  over the ranks' token slices, done by the LV-XAttn ring with causality expressed as the media mask
  (k_frame = key positions, q_vis = query positions + 1), so it returns the lse G2 hyper layers need
  and works for any token layout (`lvx_app.parallel.layout` deals them with their frames). Visual
  attention is LV-XAttn, with (`recompute=True`) or without (K/V saved per layer) the recompute
  scheme. Each forward gets its `Feed` (`TrainAttention.feed`) and visual inputs that keep one copy
  of E (`Owl3Model.prepare_visual(..., precompute=False)`); the hooks get the layer's index with
  every call.
- `checkpoint_lm_blocks(model, hooks)`: DistFlashAttn-style rematerialisation-aware checkpointing
  of the decoder layers. Each layer runs under `torch.utils.checkpoint`; the attention outputs (O,
  lse) of the first forward are kept (by the hooks), and the re-forward in backward replays them
  instead of running the attention ring again (no communication, no attention FLOPs twice).
  Everything else of the layer (norms, projections, MLP) is recomputed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lvx_app.attention.lv_xattn import lv_xattn_backward, lv_xattn_forward
from lvx_app.engine.parallelize import ShardedHooks
from lvx_app.parallel import get_rank, get_world_size
from lvx_app.parallel.collectives import exchange_sizes
from lvx_kernels.feed import Feed
from lvx_kernels.kernels import check_inputs
from lvx_kernels.masks import MaskIndex
from lvx_models.api import ForwardStep, LazyVisualKV

# --------------------------------------------------------------------------------------------------
# replay of attention outputs under rematerialisation-aware checkpointing
# --------------------------------------------------------------------------------------------------


class _Records:
    """The attention results of one checkpointed layer, in call order (text, then visual in a hyper
    layer)."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
        self.pos = 0


Phases = list[tuple[_Records, str]]  # innermost last: (records, "record" | "replay")


@contextlib.contextmanager
def _phase(phases: Phases, records: _Records, mode: str) -> Iterator[None]:
    phases.append((records, mode))
    try:
        yield
    finally:
        phases.pop()


def _attend(
    q: torch.Tensor, make_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]], spec: "_Spec"
):
    """(out, lse, query sizes): run the LV-XAttn forward ring, or replay the result recorded in the
    first forward."""
    phase = spec.phases[-1] if spec.phases else None
    if phase is not None and phase[1] == "replay":
        records = phase[0]
        out, lse, sizes = records.items[records.pos]
        records.pos += 1
        return out, lse, sizes
    k, v = make_kv()
    check_inputs(q, k, v, spec.q_vis, spec.k_frame, spec.window)
    out, lse, sizes, _sent = lv_xattn_forward(
        q,
        k,
        v,
        spec.scale,
        spec.q_vis,
        spec.k_frame,
        spec.group,
        spec.q_sizes,
        alibi=spec.alibi,
        window=spec.window,
    )
    if phase is not None:
        phase[0].items.append((out.detach(), lse.detach(), sizes))
    return out, lse, sizes


@dataclass
class _Spec:
    """What one attention call needs besides tensors autograd tracks."""

    q_vis: MaskIndex
    k_frame: MaskIndex
    group: Optional[dist.ProcessGroup]
    scale: Optional[float] = None
    project: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None
    params: list[nn.Parameter] = field(default_factory=list)
    q_sizes: Optional[list[int]] = None  # every rank's query rows (exchanged once per step)
    phases: Phases = field(default_factory=list)  # the hooks' checkpointing phases (`_attend`)
    alibi: Optional[torch.Tensor] = None  # ALiBi slopes of a text attention that has them
    window: Optional[int] = None  # the visual mask's (`VisualInputs.window`)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    return [
        (d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)
    ]


@contextlib.contextmanager
def _autocast(state: list[tuple[str, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def _ring_backward(dout, dlse, q, k, v, out, lse, spec: _Spec, sizes):
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, _sent = lv_xattn_backward(
        *(dout, dlse, q, k, v, out, lse, spec.scale, spec.q_vis, spec.k_frame, spec.group),
        *(True, sizes),
        alibi=spec.alibi,
        window=spec.window,
    )
    return dq, dk, dv


class _SavedKVAttn(torch.autograd.Function):
    """LV-XAttn that saves its K/V (text attention, and the no-recompute visual path)."""

    @staticmethod
    def forward(ctx, spec, q, k, v):
        out, lse, sizes = _attend(q, lambda: (k, v), spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.sizes = spec, sizes
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, dlse, q, k, v, out, lse, ctx.spec, ctx.sizes)
        return None, dq, dk, dv


class _RecomputeXAttn(torch.autograd.Function):
    """LV-XAttn whose K/V are a function of the shared features E: saves (q, O, lse) and a reference
    to E only.

    Inputs: q, E, then the trainable parameters `spec.project` reads (so autograd routes their
    gradients here and DDP's hooks fire on them as usual). Forward makes K/V under no_grad, runs the
    ring and drops them. Backward remakes K/V with grad enabled (and the forward's autocast state),
    runs the backward ring, and backpropagates (dK, dV) through the projection into E and the
    parameters."""

    @staticmethod
    def forward(ctx, spec, q, e, *params):
        def make_kv():
            with torch.no_grad():
                return spec.project(e)

        out, lse, sizes = _attend(q, make_kv, spec)
        ctx.save_for_backward(q, out, lse, e)
        ctx.spec, ctx.sizes, ctx.autocast = spec, sizes, _autocast_state()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, out, lse, e = ctx.saved_tensors
        spec = ctx.spec
        e_needs = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(spec.params, ctx.needs_input_grad[3:]) if need]
        grad_kv = e_needs or bool(wanted)
        with torch.set_grad_enabled(grad_kv), _autocast(ctx.autocast):
            e_in = e.detach().requires_grad_(e_needs)
            k, v = spec.project(e_in)
        dq, dk, dv = _ring_backward(
            dout, dlse, q, k.detach(), v.detach(), out, lse, spec, ctx.sizes
        )
        de, dparams = None, [None] * len(spec.params)
        if grad_kv:
            targets = ([e_in] if e_needs else []) + wanted
            grads = list(torch.autograd.grad((k, v), targets, (dk, dv), allow_unused=True))
            if e_needs:
                de = grads.pop(0)
            it = iter(grads)
            dparams = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, dq, de, *dparams)


# --------------------------------------------------------------------------------------------------
# the hooks
# --------------------------------------------------------------------------------------------------


class TrainAttention(ShardedHooks):
    """The model's attention hooks in training over `group` (None = one process): every forward is
    sharded (`feed` makes its `Feed`), and every rank of the group must run every layer (also with
    no frames or no tokens). Text attention is the LV-XAttn ring with causality as the media mask,
    as in inference's sharded prefill; visual attention is LV-XAttn with (`recompute=True`) or
    without (K/V saved per layer) the recompute scheme, given visual inputs whose K/V are made from
    one copy of E (`Owl3Model.prepare_visual(..., precompute=False)`)."""

    def __init__(
        self, model: nn.Module, *, group: Optional[dist.ProcessGroup] = None, recompute: bool = True
    ):
        super().__init__(group, get_rank(group), get_world_size(group))
        self.model, self.recompute = model, recompute
        self.phases: Phases = []  # checkpointed layers' record/replay, innermost last

    def phase(self, records: _Records, mode: str) -> contextlib.AbstractContextManager[None]:
        """While a checkpointed layer runs: keep ("record") or give back ("replay") the results
        of its attention calls."""
        return _phase(self.phases, records, mode)

    def feed(self, positions: torch.Tensor, device: torch.device) -> Feed:
        """The feed of one training forward: this rank's token positions (1, L_local), on the host,
        and every rank's token count (one all_gather per step: every layer's rings reuse it)."""
        (sizes,) = exchange_sizes(positions.shape[-1], group=self.group, device=device)
        return self.sharded_feed(positions, sizes, device)

    def ring(
        self,
        q,
        k,
        v,
        q_vis,
        k_frame,
        step: ForwardStep,
        layer: int,
        every=None,
        alibi=None,
        window=None,
    ):
        """LV-XAttn that saves its K/V (text attention, and the visual one without recompute);
        a training feed holds no host copies of the other ranks' masks (`every` is None)."""
        spec = _Spec(
            q_vis=q_vis,
            k_frame=k_frame,
            group=self.group,
            q_sizes=step.feed.sizes,
            phases=self.phases,
            alibi=alibi,
            window=window,
        )
        return _SavedKVAttn.apply(spec, q, k, v)

    def text(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: ForwardStep, layer: int
    ):
        if step.feed.replicated or k.shape[1] != q.shape[1]:
            raise RuntimeError(
                "a training forward is sharded and has no text KV cache: pass "
                "feed=TrainAttention.feed(positions, device) to the model"
            )
        return super().text(q, k, v, step, layer)

    def visual(self, q: torch.Tensor, step: ForwardStep, layer: int):
        vis = step.visual
        if not (self.recompute and isinstance(vis.kv, LazyVisualKV)):
            return super().visual(q, step, layer)
        kv = vis.kv
        spec = _Spec(
            q_vis=vis.q_vis,
            k_frame=vis.k_frame,
            group=self.group,
            project=lambda e: kv.project(layer, e),
            params=self._layer_params(layer),
            q_sizes=step.feed.sizes,
            phases=self.phases,
            window=vis.window,
        )
        return _RecomputeXAttn.apply(spec, q, kv.features, *spec.params)

    def _layer_params(self, layer: int) -> list[nn.Parameter]:
        """The trainable parameters the layer's visual K/V are made with: where dK/dV go."""
        return [p for p in self.model.visual_kv_parameters(layer) if p.requires_grad]


# --------------------------------------------------------------------------------------------------
# rematerialisation-aware checkpointing of the decoder layers
# --------------------------------------------------------------------------------------------------


def checkpoint_lm_blocks(model: Any, hooks: TrainAttention) -> None:
    """Run every decoder layer of `model` under non-reentrant `torch.utils.checkpoint`, with the
    attention outputs kept from the first forward and replayed (not recomputed) when the layer is
    re-run in backward (`hooks`, the `TrainAttention` its forwards get, keep and replay them).

    Saved per layer: its input x and the attention (O, lse) of its text (and visual) attention; the
    attention backward ring still runs once, as without checkpointing."""

    def wrap(inner: Callable) -> Callable:
        def fwd(*args):
            records = _Records()
            return checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=lambda: (hooks.phase(records, "record"), hooks.phase(records, "replay")),
            )

        return fwd

    model.checkpoint_layers(wrap)
