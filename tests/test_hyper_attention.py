"""Hyper attention of both generations against naive float64 references of the official rules.

The reference below is written from reference/mplug_owl3.md §2 with no code shared with models/:
pairwise RoPE, a dense joint mask, one softmax over [visual keys; text keys] (G2) or a separate
masked cross-attention mixed by the sigmoid gate (G1). Also the toy-sequence rules (which frames a
token sees, MI-RoPE positions) and the head-major v_kv_proj split. Helpers here (`tiny_config`,
`tiny_model`) are shared by the other model tests.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lvx_models.mplug_owl3.config import Owl3Config, SiglipVisionConfig, split_form
from lvx_models.mplug_owl3.hyper import frame_rope_positions, split_kv, visible_frames
from lvx_models.mplug_owl3.modeling import Owl3Model

P = 4  # visual tokens per frame in the tiny config (28 px / patch 14 -> 2x2)


def tiny_config(form: str = "g2", *, tied: bool | None = None, hyper_layers=(2, 4)) -> Owl3Config:
    """A few-kB mPLUG-Owl3: 4 decoder layers (hyper layers 2 and 4, 1-based), GQA 4/2 heads of
    16. `form` is a
    checkpoint generation label: "g1-gateproj" (input-dependent gate), "g1" (constant gate) or
    "g2"."""
    generation, gate_form = split_form(form)
    return Owl3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        hyper_layers=list(hyper_layers),
        tie_word_embeddings=(generation == "g1") if tied is None else tied,
        vision=SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        generation=generation,
        projector="linear" if generation == "g1" else "mlp",
        gate_form=gate_form,
    )


def tiny_model(cfg: Owl3Config, seed: int = 0, dtype=torch.float64) -> Owl3Model:
    """Random weights at a scale where attention is far from uniform (norm weights and gate not at
    init)."""
    torch.manual_seed(seed)
    model = Owl3Model(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.normal_()
            elif p.dim() == 2:
                p.normal_(0, 1.5 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0, 0.3)
    return model.eval()


# --------------------------------------------------------------------------------------------------
# naive reference


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x (..., n, heads, d) rotated at integer positions pos (n,): pair (i, i + d/2) by angle pos *
    theta^(-2i/d)."""
    d = x.shape[-1]
    # (n, d/2)
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _softmax_attend(q, k, v, vis):
    """q (L, h, d), k/v (S, h, d), vis (L, S) bool -> (L, h, d); rows with no visible key give 0."""
    s = torch.einsum("lhd,shd->hls", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hls,shd->lhd", p, v)


def reference_logits(
    model: Owl3Model, ids: torch.Tensor, E: torch.Tensor | None, starts: list[int]
):
    """Whole forward of one sequence (positions 0..L-1) in float64, straight from the rules."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    lm = "language_model.model."
    nh, nkv, hd, eps, th = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        cfg.rope_theta,
    )
    rep = nh // nkv
    L = ids.shape[1]
    t = torch.arange(L)
    x = sd[lm + "embed_tokens.weight"][ids[0]]
    causal = t[None, :] <= t[:, None]
    for i in range(cfg.num_hidden_layers):
        p = f"{lm}layers.{i}."

        def lin(name, h):
            return h @ sd[p + name + ".weight"].T + sd.get(p + name + ".bias", 0)

        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rope(lin("self_attn.q_proj", h).view(L, nh, hd), t, th)
        k = _rope(lin("self_attn.k_proj", h).view(L, nkv, hd), t, th).repeat_interleave(rep, 1)
        v = lin("self_attn.v_proj", h).view(L, nkv, hd).repeat_interleave(rep, 1)
        if (i + 1) in cfg.hyper_layers and E is not None and len(starts):
            n = E.shape[0]
            kv = lin("self_attn.v_kv_proj", _rms(E.double(), sd[p + "input_layernorm.weight"], eps))
            kv = kv.view(n, P, nkv, 2, hd)  # head-major: (kv_head, {K, V}, d)
            st = torch.tensor(starts)
            fpos = st if cfg.generation == "g2" else st + 1
            kvis = torch.stack(
                [_rope(kv[j, :, :, 0], fpos[j].repeat(P), th) for j in range(n)]
            ).reshape(n * P, nkv, hd)
            vvis = kv[:, :, :, 1].reshape(n * P, nkv, hd)
            kvis, vvis = kvis.repeat_interleave(rep, 1), vvis.repeat_interleave(rep, 1)
            frame = torch.arange(n).repeat_interleave(P)
            if cfg.generation == "g2":
                vis_v = t[:, None] >= st[frame][None, :]
                o = _softmax_attend(
                    q, torch.cat([kvis, k]), torch.cat([vvis, v]), torch.cat([vis_v, causal], 1)
                )
            else:
                vis_v = st[frame][None, :] < t[:, None]
                sa = _softmax_attend(q, k, v, causal)
                ca = _softmax_attend(q, kvis, vvis, vis_v)
                if (
                    p + "self_attn.gate_proj.0.weight" in sd
                ):  # 240728: per token and head, from C_sa
                    g = torch.sigmoid(
                        sa @ sd[p + "self_attn.gate_proj.0.weight"].T
                        + sd[p + "self_attn.gate_proj.0.bias"]
                    )
                else:
                    g = torch.sigmoid(sd[p + "self_attn.gate"]).view(nh, hd)
                o = torch.where(vis_v.any(1)[:, None, None], (1 - g) * sa + g * ca, sa)
        else:
            o = _softmax_attend(q, k, v, causal)
        x = x + o.reshape(L, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (
            h @ sd[p + "mlp.up_proj.weight"].T
        )
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    x = _rms(x, sd[lm + "norm.weight"], eps)
    w = sd.get("language_model.lm_head.weight", sd[lm + "embed_tokens.weight"])
    return (x @ w.T)[None]


# --------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("generation", ["g1-gateproj", "g1", "g2"])
def test_model_matches_naive_reference(generation):
    """Split text/visual attention (+ LSE merge for G2, gate for G1) == the naive rules, tokens
    before, between and after the placeholders included."""
    cfg = tiny_config(generation)
    model = tiny_model(cfg)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    starts = [3, 8, 9, 14]  # 8 and 9: a frame whose placeholder starts right after another's
    E = torch.randn(len(starts), P, cfg.hidden_size, dtype=torch.float64)
    got = model(ids, visual=model.prepare_visual(E, torch.tensor(starts)))
    want = reference_logits(model, ids, E, starts)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # float32 runs the CPU fused kernels (not the float64 math path)
    m32 = copy.deepcopy(model).float()
    got32 = m32(ids, visual=m32.prepare_visual(E.float(), torch.tensor(starts)))
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # and without frames: plain Qwen2
    torch.testing.assert_close(
        model(ids), reference_logits(model, ids, None, []), rtol=1e-10, atol=1e-10
    )


@pytest.mark.parametrize("generation", ["g1", "g2"])
def test_images_from_the_vision_tower(generation):
    """encode_images -> prepare_visual -> forward, end to end (projector type per generation)."""
    cfg = tiny_config(generation)
    model = tiny_model(cfg)
    px = torch.rand(2, 3, 28, 28, dtype=torch.float64) * 2 - 1
    E = model.encode_images(px, batch_size=1)
    assert E.shape == (2, P, cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    got = model(ids, visual=model.prepare_visual(E, torch.tensor([2, 7])))
    torch.testing.assert_close(got, reference_logits(model, ids, E, [2, 7]), rtol=1e-10, atol=1e-10)


def test_gate_proj_with_zero_weight_is_the_constant_gate():
    """gate_proj with W = 0 and bias b is the constant gate with `gate` = b repeated per head (the
    two G1 forms agree where they should); a non-zero W makes the gate depend on C_sa and changes
    the logits."""
    proj = tiny_model(tiny_config("g1-gateproj"))
    const = Owl3Model(tiny_config("g1")).double().eval()
    sd = {k: v for k, v in proj.state_dict().items() if ".self_attn.gate_proj." not in k}
    for i in proj.config.hyper_layer_indices:
        attn = proj.language_model.model.layers[i].self_attn
        sd[f"language_model.model.layers.{i}.self_attn.gate"] = (
            attn.gate_proj[0].bias.detach().repeat(4)
        )
    const.load_state_dict(sd)
    ids = torch.randint(0, 97, (1, 14))
    E = torch.randn(3, P, 64, dtype=torch.float64)
    starts = torch.tensor([2, 6, 9])
    with_w = proj(ids, visual=proj.prepare_visual(E, starts))
    with torch.no_grad():
        for i in proj.config.hyper_layer_indices:
            proj.language_model.model.layers[i].self_attn.gate_proj[0].weight.zero_()
    zero_w = proj(ids, visual=proj.prepare_visual(E, starts))
    torch.testing.assert_close(
        zero_w, const(ids, visual=const.prepare_visual(E, starts)), rtol=0, atol=0
    )
    assert (with_w - zero_w).abs().max() > 1e-3
    # no frames: the gate is never used
    torch.testing.assert_close(proj(ids), const(ids), rtol=0, atol=0)


def test_g2_split_merge_equals_one_fused_softmax():
    """One hyper layer in isolation: text (out, lse) merged with visual (out, lse) == one softmax
    over [visual; text] keys with the joint mask, including rows that see no frame and a decode-like
    last row."""
    from lvx_kernels.kernels import attention
    from lvx_kernels.merge import merge

    torch.manual_seed(0)
    L, S, h, hkv, d = 9, 12, 4, 2, 16
    q = torch.randn(1, L, h, d, dtype=torch.float64)
    kt, vt = torch.randn(2, 1, L, hkv, d, dtype=torch.float64)
    kv, vv = torch.randn(2, 1, S, hkv, d, dtype=torch.float64)
    k_frame = torch.arange(3).repeat_interleave(4)[None]
    q_vis = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3, 3]])
    out_t, lse_t = attention(q, kt, vt, causal=True)
    out_v, lse_v = attention(q, kv, vv, q_vis=q_vis, k_frame=k_frame)
    out, lse = merge(out_t, lse_t, out_v, lse_v)
    # fused reference
    keys = torch.cat([kv, kt], 1)[0].repeat_interleave(2, 1)
    vals = torch.cat([vv, vt], 1)[0].repeat_interleave(2, 1)
    t = torch.arange(L)
    mask = torch.cat([k_frame[0][None, :] < q_vis[0][:, None], t[None, :] <= t[:, None]], 1)
    s = torch.einsum("lhd,shd->hls", q[0], keys) / math.sqrt(d)
    s = s.masked_fill(~mask, float("-inf"))
    want = torch.einsum("hls,shd->lhd", s.softmax(-1), vals)
    torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[0], s.logsumexp(-1), rtol=1e-12, atol=1e-12)


def test_visible_frames_and_mi_rope_positions_on_a_toy_sequence():
    starts = torch.tensor([2, 5, 9])
    t = torch.arange(12)
    # G2: t sees j iff t >= start_j
    assert visible_frames(t, starts, "g2").tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    # G1: t sees j iff start_j < t (the processor's count #{j: t > start_j})
    g1 = visible_frames(t, starts, "g1")
    assert g1.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert g1.tolist() == [int((starts < int(i)).sum()) for i in t]
    assert frame_rope_positions(starts, "g2").tolist() == [2, 5, 9]
    assert frame_rope_positions(starts, "g1").tolist() == [3, 6, 10]
    # G1 official derivation: positions where the per-token count increases, + 1
    assert ((g1[1:] - g1[:-1]).nonzero().flatten() + 1).tolist() == [3, 6, 10]
    # a decode token (after the prompt) sees every frame in both generations; shape is kept
    pos = torch.tensor([[12, 40]])
    assert (
        visible_frames(pos, starts, "g1").tolist()
        == [[3, 3]]
        == visible_frames(pos, starts, "g2").tolist()
    )


def test_v_kv_proj_split_is_head_major():
    n_kv, hd = 3, 4
    out = torch.arange(2 * n_kv * hd).view(1, -1)  # column index as value
    k, v = split_kv(out, n_kv, hd)
    for h in range(n_kv):
        assert k[0, h].tolist() == list(range(h * 2 * hd, h * 2 * hd + hd))
        assert v[0, h].tolist() == list(range(h * 2 * hd + hd, h * 2 * hd + 2 * hd))


def test_mi_rope_is_relative_to_the_frame_position():
    """Scores of a text query at position t against frame keys depend only on t - p_j."""
    cfg = tiny_config("g2")
    model = tiny_model(cfg)
    E = torch.randn(1, P, cfg.hidden_size, dtype=torch.float64)
    q = torch.randn(1, 1, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float64)
    from lvx_models.mplug_owl3.layers import apply_rope, rope_cos_sin

    def scores(t, p):
        k, _ = model.visual_kv(1, E, torch.tensor([p]))
        cos, sin = rope_cos_sin(torch.tensor([[t]]), cfg.head_dim, cfg.rope_theta, torch.float64)
        return torch.einsum("bqhd,bkhd->hk", apply_rope(q, cos, sin), k)

    # float64 angles
    torch.testing.assert_close(scores(30, 7), scores(40023, 40000), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="not a hyper layer"):
        model.visual_kv(0, E, torch.tensor([0]))


@pytest.mark.parametrize("frames", [0, 1, 7])
def test_visual_kv_in_chunks_equals_one_pass_and_keeps_no_projection_alive(monkeypatch, frames):
    """Without autograd the frames are projected a chunk at a time into K and V buffers of their
    own: the same values as the one pass autograd takes, and V is not a view of the whole (K | V)
    projection."""
    from lvx_models.mplug_owl3 import hyper

    cfg = tiny_config("g2")
    model = tiny_model(cfg)
    E = torch.randn(frames, P, cfg.hidden_size, dtype=torch.float64)
    positions = torch.arange(frames) * 5 + 3
    # grad enabled: the whole at once
    one_pass = [t.detach() for t in model.visual_kv(1, E, positions)]
    # 3 frames a chunk
    monkeypatch.setattr(hyper, "VISUAL_KV_CHUNK_BYTES", 3 * P * cfg.hidden_size * 8)
    with torch.no_grad():
        k, v = model.visual_kv(1, E, positions)
    torch.testing.assert_close(k, one_pass[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(v, one_pass[1], rtol=0, atol=1e-12)
    for t in (k, v):
        assert (
            t.shape == (1, frames * P, cfg.num_key_value_heads, cfg.head_dim) and t.is_contiguous()
        )
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (
            "nothing else kept alive"
        )


def test_injected_visual_attention_is_used():
    """The engine swaps `hooks.visual`; the model must route every hyper layer's visual attention
    through it, with the forward's step context (its feed, its visual inputs with what the host
    knows of them) and the calling layer's index."""
    from lvx_kernels.feed import Feed
    from lvx_kernels.kernels import attention
    from lvx_kernels.masks import Indices

    cfg = tiny_config("g2")
    model = tiny_model(cfg)
    calls = []
    feed = Feed(sizes=(6,))

    def spy(q, step, layer):
        vis = step.visual
        k, v = vis.kv[layer]
        assert step.feed is feed and isinstance(vis.q_vis, Indices)
        calls.append((layer, tuple(q.shape), tuple(k.shape), vis.q_vis.values.tolist()))
        return attention(q, k, v, q_vis=vis.q_vis, k_frame=vis.k_frame)

    model.hooks.visual = spy
    E = torch.randn(2, P, cfg.hidden_size, dtype=torch.float64)
    ids, visual = torch.randint(0, 97, (1, 6)), model.prepare_visual(E, torch.tensor([1, 3]))
    model(ids, torch.arange(6).view(1, -1), visual=visual, feed=feed)
    assert [c[0] for c in calls] == cfg.hyper_layer_indices
    assert calls[0][1:] == ((1, 6, 4, 16), (1, 2 * P, 2, 16), [[0, 1, 1, 2, 2, 2]])


def test_recomputed_visual_kv_equals_precomputed_and_has_gradients():
    """precompute=False keeps only E; each forward recomputes K/V per layer, differentiably."""
    cfg = tiny_config("g1")
    model = tiny_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    starts = torch.tensor([1, 4])
    E = torch.randn(2, P, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    want = model(ids, visual=model.prepare_visual(E, starts)).detach()
    lazy = model.prepare_visual(E, starts, precompute=False)
    assert sorted(lazy.kv) == cfg.hyper_layer_indices
    got = model(ids, visual=lazy)
    torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert E.grad is not None and E.grad.abs().sum() > 0
    assert model.language_model.model.layers[1].self_attn.v_kv_proj.weight.grad.abs().sum() > 0
