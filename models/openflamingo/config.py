"""OpenFlamingo's config: the CLIP vision tower (open_clip's `VisionTransformer`), the perceiver
resampler, the MPT text model and the gated cross-attention blocks open_flamingo inserts into it.

OpenFlamingo checkpoints ship no `config.json`: the sizes are those of the models the release names
(`published.py`): open_clip's ViT-L/14 (`openai` weights), the MPT config.json of its language
model, and open_flamingo's defaults for the perceiver (depth 6, 8 heads of 64, 64 latents) and the
cross layers (8 heads of 64, a feed-forward 4x wide, one before every `cross_attn_every_n_layers`th
decoder block). Defaults are the 3B release's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

GENERATION = "v2"  # the open_flamingo 2.0 releases (the 3B and 9B the LV-XAttn paper runs)
# Float32 work of one chunk of frames while a cross layer's K/V are made (as the other families')
VISUAL_KV_CHUNK_BYTES = 256 * 2**20
# Prompt tokens before the first frame: none (a prompt starts with the first frame's `<image>`)
PROMPT_HEADER_TOKENS = 0


@dataclass
class VisionConfig:
    """open_clip's `VisionTransformer` (`vision_cfg` of its model config; ViT-L-14 by default)."""

    image_size: int = 224
    patch_size: int = 14
    width: int = 1024
    layers: int = 24
    heads: int = 16
    mlp_ratio: float = 4.0
    output_dim: int = 768  # `proj`'s width (the pooled CLIP embedding; OpenFlamingo takes tokens)
    quick_gelu: bool = True  # the `openai` weights' activation
    layer_norm_eps: float = 1e-5
    channels: int = 3

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Tokens the tower runs on one image: its patches and the class token (257 at 224/14)."""
        return self.grid**2 + 1

    @property
    def intermediate_size(self) -> int:
        return int(self.width * self.mlp_ratio)


@dataclass
class PerceiverConfig:
    """open_flamingo's `PerceiverResampler` (its `dim` is the vision tower's width)."""

    depth: int = 6
    dim_head: int = 64
    heads: int = 8
    num_latents: int = 64
    max_num_media: int | None = None  # `media_time_embs` rows (none in the released models)
    max_num_frames: int | None = None  # `frame_embs` rows (none in the released models)
    ff_mult: int = 4


@dataclass
class MptConfig:
    """The MPT text model, by the names of MPT's `config.json` (`attn_config` flattened)."""

    d_model: int = 2048
    n_heads: int = 16
    n_layers: int = 24
    expansion_ratio: int = 4
    vocab_size: int = 50280  # the embedding rows after open_flamingo adds its tokens
    max_seq_len: int = 2048
    alibi: bool = True
    alibi_bias_max: int = 8
    qk_ln: bool = True  # LayerNorm over the whole width on q and k (MPT-1B's `attn_qk_ln`)
    clip_qkv: float | None = None
    softmax_scale: float | None = None  # None: 1 / sqrt(head size)
    no_bias: bool = True  # no bias in the linears and the LayerNorms
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True  # logits are the hidden states times `wte`

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class OpenFlamingoConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    perceiver: PerceiverConfig = field(default_factory=PerceiverConfig)
    text: MptConfig = field(default_factory=MptConfig)
    cross_attn_every_n_layers: int = 1
    cross_dim_head: int = 64
    cross_heads: int = 8
    cross_ff_mult: int = 4
    media_token_id: int = 50278  # `<image>`
    eoc_token_id: int = 50277  # `<|endofchunk|>`

    # ---- the sizes the app's plans read, by their Hugging Face names (the text model's)
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.d_model

    @property
    def intermediate_size(self) -> int:
        return self.text.expansion_ratio * self.text.d_model

    @property
    def num_hidden_layers(self) -> int:
        return self.text.n_layers

    @property
    def num_attention_heads(self) -> int:
        return self.text.n_heads

    @property
    def num_key_value_heads(self) -> int:
        """MPT's attention is multi-head: a K/V head per query head."""
        return self.text.n_heads

    @property
    def max_position_embeddings(self) -> int:
        """The length MPT was trained at (ALiBi has no table: longer prompts run as published)."""
        return self.text.max_seq_len

    @property
    def head_dim(self) -> int:
        return self.text.head_dim

    @property
    def num_kv_groups(self) -> int:
        return 1

    @property
    def text_kv_layers(self) -> int:
        """Every decoder block keeps text K/V (a cross layer runs before a block, not instead)."""
        return self.text.n_layers

    @property
    def cross_layer_indices(self) -> list[int]:
        """The decoder blocks a gated cross-attention layer runs before: every
        `cross_attn_every_n_layers`th, as open_flamingo's `init_flamingo` places them."""
        n = self.cross_attn_every_n_layers
        return [i for i in range(self.text.n_layers) if (i + 1) % n == 0]

    @property
    def visual_feature_size(self) -> int:
        """Width of E: the perceiver's latents keep the tower's width."""
        return self.vision.width

    @property
    def cross_attention_heads(self) -> int:
        """Query heads of a gated cross layer (multi-head: as many as its K/V heads)."""
        return self.cross_heads

    @property
    def cross_kv_heads(self) -> int:
        return self.cross_heads

    @property
    def cross_head_dim(self) -> int:
        return self.cross_dim_head

    @property
    def prompt_header_tokens(self) -> int:
        return PROMPT_HEADER_TOKENS

    @property
    def prompt_positions_per_frame(self) -> int:
        """One `<image>` a frame."""
        return 1

    @property
    def visual_tokens_per_frame(self) -> int:
        """The perceiver's latents: 64 a frame."""
        return self.perceiver.num_latents

    @property
    def vision_tokens_per_frame(self) -> int:
        return self.vision.tokens

    # a video prompt opens with its first `<image>`: no header row attends to the frames
    header_visual_tokens_per_frame = 0

    @property
    def frame_size(self) -> int:
        return self.vision.image_size

    @property
    def frame_channels(self) -> int:
        return self.vision.channels

    @property
    def vision_hidden_size(self) -> int:
        return self.vision.width

    @property
    def vision_intermediate_size(self) -> int:
        return self.vision.intermediate_size

    @property
    def vision_layers(self) -> int:
        return self.vision.layers

    @property
    def vision_output_size(self) -> int:
        """The width of the tower's patch tokens (after `ln_post`, before `proj`), which the
        perceiver takes."""
        return self.vision.width

    @property
    def visual_kv_chunk_bytes(self) -> int:
        return VISUAL_KV_CHUNK_BYTES

    @property
    def generation_name(self) -> str:
        return GENERATION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpenFlamingoConfig":
        """`to_dict`'s form (unknown keys are ignored)."""
        top = {f.name for f in fields(cls)} - {"vision", "perceiver", "text"}
        return cls(
            vision=_pick(VisionConfig, d.get("vision", {})),
            perceiver=_pick(PerceiverConfig, d.get("perceiver", {})),
            text=_pick(MptConfig, d.get("text", {})),
            **{k: v for k, v in d.items() if k in top},
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pick(cls, d: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
