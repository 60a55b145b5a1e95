"""OpenFlamingo in plain PyTorch against the `open-flamingo` package on tiny random weights.

The reference is open_flamingo's `Flamingo` built by hand as its factory builds it: open_clip's
`VisionTransformer` (tokens output) as the vision encoder, transformers' `MptForCausalLM` as the
language model, turned into a Flamingo LM by open_flamingo's mixin with its decoder blocks at
`transformer.blocks`. Its cross layers attend to every frame before a row
(`only_attend_immediate_media=False`, lvx's default), the prompt starting at its first `<image>`.
transformers' MPT alone is the reference of the text model. The engine's sharded attention (2 and
3 gloo ranks, a sharded prefill, then replicated decoding) gives what one process gives.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import types

import numpy as np
import pytest
import torch

from lvx_models.openflamingo.config import (
    MptConfig,
    OpenFlamingoConfig,
    PerceiverConfig,
    VisionConfig,
)
from lvx_models.openflamingo.modeling import OpenFlamingoModel
from lvx_models.openflamingo.video_model import OpenFlamingoVideoModel
from scripts.gloo_ranks import run_ranks

MEDIA, EOC = 98, 97
PROMPT = [MEDIA, 5, 6, MEDIA, 7, MEDIA, 8, 9, 10, EOC, MEDIA, 11, 12]
FRAMES = PROMPT.count(MEDIA)
NEW_TOKENS = 5


def tiny_config(every: int = 2) -> OpenFlamingoConfig:
    return OpenFlamingoConfig(
        vision=VisionConfig(
            image_size=28, patch_size=14, width=32, layers=2, heads=4, output_dim=16
        ),
        perceiver=PerceiverConfig(),  # open_flamingo's `Flamingo` builds its defaults
        text=MptConfig(
            d_model=32, n_heads=4, n_layers=4, vocab_size=100, max_seq_len=64, qk_ln=False
        ),
        cross_attn_every_n_layers=every,
        media_token_id=MEDIA,
        eoc_token_id=EOC,
    )


@contextlib.contextmanager
def _bare_packages(*names: str):
    """Import from `names`' modules without running the packages' `__init__`, with the one
    torchvision name open_clip's utilities import (a ResNet's frozen batch norm, which a ViT never
    builds): open_clip's and open_flamingo's `__init__` import open_clip's image transforms, i.e.
    torchvision, which has no CPU build for this torch on the package index. Nothing stays in
    `sys.modules` afterwards."""
    misc = types.ModuleType("torchvision.ops.misc")
    misc.FrozenBatchNorm2d = type("FrozenBatchNorm2d", (torch.nn.Module,), {})
    fakes = {
        "torchvision": types.ModuleType("torchvision"),
        "torchvision.ops": types.ModuleType("torchvision.ops"),
        "torchvision.ops.misc": misc,
    }
    for name in names:
        package = types.ModuleType(name)
        package.__path__ = list(importlib.util.find_spec(name).submodule_search_locations)
        fakes[name] = package
    saved = {n: sys.modules.get(n) for n in fakes}
    sys.modules.update(fakes)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in set(names) | {"torchvision"}]:
            sys.modules.pop(name)
        sys.modules.update({n: m for n, m in saved.items() if m is not None})


def _reference_classes():
    """open_clip's `VisionTransformer`, `QuickGELU`; open_flamingo's `Flamingo`, its LM mixin and
    `extend_instance`."""
    with _bare_packages("open_clip", "open_flamingo"):
        sys.modules["open_flamingo.src"] = types.ModuleType("open_flamingo.src")
        sys.modules["open_flamingo.src"].__path__ = [
            f"{sys.modules['open_flamingo'].__path__[0]}/src"
        ]
        from open_clip.transformer import QuickGELU, VisionTransformer
        from open_flamingo.src.flamingo import Flamingo
        from open_flamingo.src.flamingo_lm import FlamingoLMMixin
        from open_flamingo.src.utils import extend_instance

        return VisionTransformer, QuickGELU, Flamingo, FlamingoLMMixin, extend_instance


def reference_flamingo(cfg: OpenFlamingoConfig, seed: int = 0):
    """open_flamingo's `Flamingo` at `cfg`'s sizes, every weight random (gates too)."""
    from transformers import MptConfig as HFMptConfig
    from transformers import MptForCausalLM

    VisionTransformer, QuickGELU, Flamingo, FlamingoLMMixin, extend_instance = _reference_classes()
    torch.manual_seed(seed)
    v = cfg.vision
    visual = VisionTransformer(
        image_size=v.image_size,
        patch_size=v.patch_size,
        width=v.width,
        layers=v.layers,
        heads=v.heads,
        mlp_ratio=v.mlp_ratio,
        output_dim=v.output_dim,
        act_layer=QuickGELU,
        output_tokens=True,
    )
    t = cfg.text
    attn = {"alibi": True, "alibi_bias_max": t.alibi_bias_max, "attn_impl": "torch"}
    lm = MptForCausalLM(
        HFMptConfig(
            d_model=t.d_model,
            n_heads=t.n_heads,
            n_layers=t.n_layers,
            expansion_ratio=4,
            max_seq_len=t.max_seq_len,
            vocab_size=t.vocab_size,
            no_bias=True,
            attn_config=attn,
        )
    )
    extend_instance(lm, FlamingoLMMixin)
    lm.set_decoder_layers_attr_name("transformer.blocks")
    model = Flamingo(
        types.SimpleNamespace(visual=visual),
        lm,
        EOC,
        MEDIA,
        vis_dim=v.width,
        cross_attn_every_n_layers=cfg.cross_attn_every_n_layers,
    )
    for layer in model.lang_encoder.gated_cross_attn_layers:
        if layer is not None:
            layer.attn.only_attend_immediate_media = False
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model.eval()


def ours_from(reference, cfg: OpenFlamingoConfig, dtype=torch.float32) -> OpenFlamingoVideoModel:
    """lvx's model with the reference's weights, loaded by name (strict)."""
    skip = ("lang_encoder.old_decoder_blocks.", "lang_encoder.gated_cross_attn_layers.")
    state = {
        k: v
        for k, v in reference.state_dict().items()
        if not k.startswith(skip) and k != "lang_encoder.lm_head.weight"
    }
    model = OpenFlamingoModel(cfg)
    model.load_state_dict(state, strict=True)
    return OpenFlamingoVideoModel(model.to(dtype).eval())


def _pixels(seed: int = 1) -> torch.Tensor:
    return torch.randn(FRAMES, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


def _media_starts() -> torch.Tensor:
    return torch.tensor([i for i, t in enumerate(PROMPT) if t == MEDIA])


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_config()
    reference = reference_flamingo(cfg)
    return reference, ours_from(reference, cfg), cfg


def _reference_logits(reference, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(pixels[None, :, None], ids).logits


def _reference_greedy(reference, pixels: torch.Tensor) -> list[int]:
    """Greedy tokens by the reference's own forward over the whole sequence each step."""
    ids, tokens = torch.tensor([PROMPT]), []
    for _ in range(NEW_TOKENS):
        token = int(_reference_logits(reference, ids, pixels)[0, -1].argmax())
        tokens.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens


def greedy(model: OpenFlamingoVideoModel, visual, hooks=None, prefill=None) -> list[int]:
    """Prefill the prompt on a text cache, then one token at a time."""
    cache = model.new_cache()
    with torch.no_grad():
        logits = (
            prefill(cache)
            if prefill
            else model(torch.tensor([PROMPT]), cache=cache, visual=visual, hooks=hooks)
        )
        tokens = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), cache=cache, visual=visual, hooks=hooks)
    return tokens


def test_the_vision_tower_and_perceiver_are_open_flamingos(pair):
    reference, ours, _ = pair
    pixels = _pixels()
    with torch.no_grad():
        want = reference.perceiver(reference.vision_encoder(pixels)[1][:, None, None])[:, 0]
        got = ours.encode_images(pixels)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logits_and_greedy_tokens_match_open_flamingo(pair):
    reference, ours, _ = pair
    pixels = _pixels()
    want = _reference_logits(reference, torch.tensor([PROMPT]), pixels)
    visual = ours.prepare_visual(ours.encode_images(pixels), _media_starts())
    with torch.no_grad():
        got = ours(torch.tensor([PROMPT]), cache=ours.new_cache(), visual=visual)
    assert (got - want).abs().max() < 1e-5
    assert greedy(ours, visual) == _reference_greedy(reference, pixels)


def test_the_text_model_is_transformers_mpt():
    """Without cross layers the text model is MPT's (ALiBi, no biases, tied head), its weights
    loaded by the key map of `modeling` from MPT's own names."""
    from transformers import MptForCausalLM

    cfg = tiny_config(every=5)  # more than the blocks: none has a cross layer
    assert cfg.cross_layer_indices == []
    plain = reference_flamingo(cfg).lang_encoder  # MPT's tensors, random
    mpt = MptForCausalLM(plain.config).eval()
    own = {k.replace(".decoder_layer.", "."): v for k, v in plain.state_dict().items()}
    mpt.load_state_dict({k: own[k] for k in mpt.state_dict()})
    state = {  # MPT's `transformer.blocks.{i}.X` is `blocks.{i}.decoder_layer.X` here
        "lang_encoder." + re.sub(r"^(transformer\.blocks\.\d+)\.", r"\1.decoder_layer.", k): v
        for k, v in mpt.state_dict().items()
        if k != "lm_head.weight"  # tied to `wte`
    }
    ours = OpenFlamingoModel(cfg)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith(("vision_encoder.", "perceiver.")) for k in missing)
    ours = OpenFlamingoVideoModel(ours.eval())
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = mpt(ids).logits
        got = ours(ids, cache=ours.new_cache())
    assert want.abs().max() > 0.1 and (got - want).abs().max() < 1e-5


def _sharded_run(rank: int, world: int, seed: int):
    """This rank's share of the prompt and the frames in a sharded prefill, then replicated
    decoding, through the engine's sharded attention: {dtype: (every row's logits, tokens)} in
    float32 and float64."""
    from lvx_app.engine.parallelize import ShardedAttention
    from lvx_app.parallel.collectives import allgather_seq

    cfg = tiny_config()
    reference = reference_flamingo(cfg, seed)
    hooks = ShardedAttention(None, rank, world)
    every = [p.view(1, -1) for p in torch.tensor_split(torch.arange(len(PROMPT)), world)]
    sizes = [p.numel() for p in every]
    mine = torch.tensor_split(torch.arange(FRAMES), world)[rank]
    results = {}
    for dtype in (torch.float32, torch.float64):
        model = ours_from(reference, cfg, dtype)
        e = model.encode_images(_pixels().to(dtype)[mine])
        visual = model.prepare_visual(e, _media_starts(), frame_ids=mine)

        def prefill(cache):
            feed = hooks.sharded_feed(every[rank], sizes, torch.device("cpu"), every=every)
            ids = torch.tensor([PROMPT])[:, every[rank][0]]
            logits = model(ids, every[rank], cache=cache, visual=visual, feed=feed, hooks=hooks)
            hooks.replicate(cache, 0, every[rank], sizes)
            prefill.logits = allgather_seq(logits.contiguous(), sizes, None)[0].numpy()
            return torch.from_numpy(prefill.logits)

        tokens = greedy(model, visual, hooks, prefill)
        results[str(dtype)] = prefill.logits, tokens
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_open_flamingo_and_one_process_in_float64(world):
    """Over the ranks, float32 is open_flamingo's (1e-5, the same tokens) and float64 is one
    process's."""
    cfg = tiny_config()
    reference = reference_flamingo(cfg, 0)
    want32 = _reference_logits(reference, torch.tensor([PROMPT]), _pixels())
    tokens32 = _reference_greedy(reference, _pixels())
    model = ours_from(reference, cfg, torch.float64)
    visual = model.prepare_visual(model.encode_images(_pixels().to(torch.float64)), _media_starts())
    with torch.no_grad():
        want64 = model(torch.tensor([PROMPT]), cache=model.new_cache(), visual=visual)
    tokens64 = greedy(model, visual)
    for rank, got in enumerate(run_ranks(_sharded_run, world, 0)):
        logits, tokens = got[str(torch.float32)]
        assert np.abs(logits - want32.numpy()).max() < 1e-5 and tokens == tokens32, rank
        logits, tokens = got[str(torch.float64)]
        np.testing.assert_allclose(logits, want64.numpy(), rtol=1e-10, atol=1e-10)
        assert tokens == tokens64, f"rank {rank}"


def test_alibi_attention_and_its_gradients_are_the_dense_formula():
    """The kernels' ALiBi (causal, bottom-right: a second block of rows after cached keys) against
    softmax(q k^T / sqrt(d) + slope * (j - i)) and its autograd, float64."""
    from lvx_kernels.kernels import attention
    from lvx_models.openflamingo.mpt import alibi_slopes

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    slopes = alibi_slopes(4, 8)
    out, lse = attention(q, k, v, causal=True, alibi=slopes)
    i = torch.arange(5)[:, None] + 4
    j = torch.arange(9)[None, :]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5 + slopes.double().view(1, 4, 1, 1) * (j - i)
    s = s.masked_fill(j > i, float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, s.logsumexp(-1))
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v))
    expected = torch.autograd.grad((want * w).sum() + s.logsumexp(-1).sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_alibi_decoding_on_a_fixed_buffer_is_the_causal_one():
    """A decoded token against the first `used` keys of a longer buffer (the captured decode step)
    gets the bias of the causal call on those keys alone."""
    from lvx_kernels.kernels import attn_fwd, attn_fwd_upto
    from lvx_models.openflamingo.mpt import alibi_slopes

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    slopes = alibi_slopes(4, 8)
    got = attn_fwd_upto(q, k, v, torch.tensor([7], dtype=torch.int32), alibi=slopes)
    want = attn_fwd(q, k[:, :7], v[:, :7], causal=True, alibi=slopes)
    plain = attn_fwd(q, k[:, :7], v[:, :7], causal=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(got[0], plain[0])
