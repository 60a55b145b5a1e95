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
- `TrainAttention`: the `AttentionHooks` the model calls. Text self-attention is sharded causal
  attention over the ranks' token slices, done by the LV-XAttn ring with causality expressed as the
  media mask (k_frame = key positions, q_vis = query positions + 1), so it returns the lse G2 hyper
  layers need and works for any token layout (`lvx_app.parallel.layout` deals them with their
  frames). Visual attention is LV-XAttn, with (`recompute=True`) or without (K/V saved per layer)
  the recompute scheme.
- `TrainAttention.visual_inputs(...)`: the matching `VisualInputs` for `Owl3Model.forward`.
- `checkpoint_lm_blocks(model)`: DistFlashAttn-style rematerialisation-aware checkpointing of the
  decoder layers. Each layer runs under `torch.utils.checkpoint`; the attention outputs (O, lse) of
  the first forward are kept, and the re-forward in backward replays them instead of running the
  attention ring again (no communication, no attention FLOPs twice). Everything else of the layer
  (norms, projections, MLP) is recomputed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lvx_app.attention.kernels import check_inputs
from lvx_app.attention.lv_xattn import lv_xattn_backward, lv_xattn_forward
from lvx_app.parallel.collectives import exchange_sizes

# --------------------------------------------------------------------------------------------------
# replay of attention outputs under rematerialisation-aware checkpointing
# --------------------------------------------------------------------------------------------------


class _Records:
    """The attention results of one checkpointed layer, in call order (text, then visual in a hyper
    layer)."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
        self.pos = 0


_PHASE: list[tuple[_Records, str]] = []  # innermost active (records, "record" | "replay")


@contextlib.contextmanager
def _phase(records: _Records, mode: str) -> Iterator[None]:
    _PHASE.append((records, mode))
    try:
        yield
    finally:
        _PHASE.pop()


def _attend(
    q: torch.Tensor, make_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]], spec: "_Spec"
):
    """(out, lse, query sizes): run the LV-XAttn forward ring, or replay the result recorded in the
    first forward."""
    phase = _PHASE[-1] if _PHASE else None
    if phase is not None and phase[1] == "replay":
        records = phase[0]
        out, lse, sizes = records.items[records.pos]
        records.pos += 1
        return out, lse, sizes
    k, v = make_kv()
    check_inputs(q, k, v, spec.q_vis, spec.k_frame)
    out, lse, sizes, _sent = lv_xattn_forward(
        q, k, v, spec.scale, spec.q_vis, spec.k_frame, spec.group, spec.q_sizes
    )
    if phase is not None:
        phase[0].items.append((out.detach(), lse.detach(), sizes))
    return out, lse, sizes


@dataclass
class _Spec:
    """What one attention call needs besides tensors autograd tracks."""

    q_vis: torch.Tensor
    k_frame: torch.Tensor
    group: Optional[dist.ProcessGroup]
    scale: Optional[float] = None
    project: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None
    params: list[nn.Parameter] = field(default_factory=list)
    q_sizes: Optional[list[int]] = None  # every rank's query rows (exchanged once per step)


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
        dout, dlse, q, k, v, out, lse, spec.scale, spec.q_vis, spec.k_frame, spec.group, True, sizes
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


class _Handles(Mapping):
    """layer -> (k, v) stand-ins for `VisualInputs.kv` in recompute mode.

    The model passes what it gets here straight to `hooks.visual`; an empty tensor pair stands for
    "the K/V of layer l", and `TrainAttention.visual` makes the real K/V inside `_RecomputeXAttn`
    (or not at all when the attention result is replayed). Only valid together with the
    `TrainAttention` that made it."""

    def __init__(
        self, owner: "TrainAttention", layers: list[int], like: torch.Tensor, kv_heads: int, hd: int
    ):
        self.owner, self.layers = owner, list(layers)
        self._like = (like, kv_heads, hd)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.layers:
            raise KeyError(layer)
        like, h, d = self._like
        k = like.new_empty(1, 0, h, d)
        self.owner._pending[id(k)] = (layer, k)
        return k, k

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


class TrainAttention:
    """`AttentionHooks`-compatible text and visual attention for training over `group` (None = one
    process).

    Call `begin(positions)` with this rank's token positions (1, L_local) before each forward; every
    rank of the group must run every layer (also with no frames or no tokens)."""

    def __init__(
        self, model: nn.Module, *, group: Optional[dist.ProcessGroup] = None, recompute: bool = True
    ):
        self.model = model
        self.group = group
        self.recompute = recompute
        self.q_vis: Optional[torch.Tensor] = None
        self.k_pos: Optional[torch.Tensor] = None
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}
        self.q_sizes: Optional[list[int]] = None
        self._visual = None  # (E, frame positions, k_frame) of the current step

    def begin(self, positions: torch.Tensor) -> None:
        positions = positions.to(torch.int64).view(1, -1)
        self.k_pos = positions
        self.q_vis = positions + 1
        self._pending.clear()
        # every rank's token count, once per step: the rings of every layer reuse it
        (self.q_sizes,) = exchange_sizes(
            positions.shape[1], group=self.group, device=positions.device
        )

    # ---- text
    # ----------------------------------------------------------------------------------------------
    def text(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True):
        if not causal:
            raise ValueError("training text attention is always causal")
        if self.k_pos is None or self.k_pos.shape[1] != q.shape[1] or k.shape[1] != q.shape[1]:
            raise RuntimeError(
                "call TrainAttention.begin(positions) with this rank's token positions before the "
                "forward (no text KV cache in training)"
            )
        spec = _Spec(
            q_vis=self.q_vis.to(q.device),
            k_frame=self.k_pos.to(q.device),
            group=self.group,
            q_sizes=self.q_sizes,
        )
        return _SavedKVAttn.apply(spec, q, k, v)

    # ---- visual
    # ----------------------------------------------------------------------------------------------
    def visual_inputs(
        self, e_local: torch.Tensor, media_starts: torch.Tensor, frame_ids: torch.Tensor
    ):
        """`VisualInputs` for this rank's frames: e_local (N_local, 729, H) is the one shared copy
        of E (it may require grad, e.g. when the projector trains); media_starts (N_total,) every
        frame's placeholder start; frame_ids (N_local,) the global indices of the local frames."""
        from lvx_models.mplug_owl3.hyper import VisualInputs

        model = self.model
        if not self.recompute:
            return model.prepare_visual(e_local, media_starts, frame_ids, precompute=False)
        cfg = model.config
        dev = e_local.device
        media_starts = torch.as_tensor(media_starts, dtype=torch.int64).to(dev)
        frame_ids = torch.as_tensor(frame_ids, dtype=torch.int64).to(dev)
        n, p, _ = e_local.shape
        positions = model.frame_rope_positions(media_starts)[frame_ids]
        k_frame = frame_ids.repeat_interleave(p).view(1, n * p)
        self._visual = (e_local, positions, k_frame)
        kv = _Handles(self, cfg.hyper_layer_indices, e_local, cfg.num_key_value_heads, cfg.head_dim)
        return VisualInputs(kv=kv, k_frame=k_frame, media_starts=media_starts)

    def _layer_params(self, layer: int) -> list[nn.Parameter]:
        blk = self.model.language_model.model.layers[layer]
        mods = [blk.input_layernorm, blk.self_attn.v_kv_proj]
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def visual(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_vis: torch.Tensor,
        k_frame: torch.Tensor,
    ):
        pending = self._pending.pop(id(k), None) if k.shape[1] == 0 else None
        spec = _Spec(q_vis=q_vis, k_frame=k_frame, group=self.group, q_sizes=self.q_sizes)
        if pending is None:  # K/V given (no-recompute path)
            return _SavedKVAttn.apply(spec, q, k, v)
        layer = pending[0]
        e, positions, _ = self._visual
        spec.project = lambda e_: self.model.visual_kv(layer, e_, positions)
        spec.params = self._layer_params(layer)
        return _RecomputeXAttn.apply(spec, q, e, *spec.params)


# --------------------------------------------------------------------------------------------------
# rematerialisation-aware checkpointing of the decoder layers
# --------------------------------------------------------------------------------------------------


def checkpoint_lm_blocks(model: nn.Module) -> None:
    """Run every decoder layer of `model` under non-reentrant `torch.utils.checkpoint`, with the
    attention outputs kept from the first forward and replayed (not recomputed) when the layer is
    re-run in backward.

    Saved per layer: its input x and the attention (O, lse) of its text (and visual) attention; the
    attention backward ring still runs once, as without checkpointing. Works with `TrainAttention`
    hooks only."""
    for layer in model.language_model.model.layers:
        if getattr(layer, "_lvx_checkpointed", False):
            continue
        inner = layer.forward

        def fwd(x, ctx, _inner=inner):
            records = _Records()
            return checkpoint(
                _inner,
                x,
                ctx,
                use_reentrant=False,
                context_fn=lambda: (_phase(records, "record"), _phase(records, "replay")),
            )

        layer.forward = fwd
        layer._lvx_checkpointed = True
