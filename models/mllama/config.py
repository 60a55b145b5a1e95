"""Mllama's config, read from a published `config.json` (`text_config` and `vision_config`).

Defaults are the 11B checkpoint's values; every size is read from the file, never assumed. RoPE
comes as the published `rope_theta` + `rope_scaling` (llama3) or as the newer `rope_parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config_checks import checked_config

ASPECT_RATIOS_4 = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


GENERATION = "3.2"  # Llama-3.2-Vision: the only generation of the family so far
# Float32 work of one chunk of frames while a cross layer's K/V are made (as mPLUG-Owl3's)
VISUAL_KV_CHUNK_BYTES = 256 * 2**20
# `<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n`: the tokens before the frames
PROMPT_HEADER_TOKENS = 5


@dataclass
class MllamaVisionConfig:
    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_global_layers: int = 8
    attention_heads: int = 16
    num_channels: int = 3
    intermediate_size: int = 5120
    vision_output_dim: int = 7680
    image_size: int = 560
    patch_size: int = 14
    norm_eps: float = 1e-5
    max_num_tiles: int = 4
    intermediate_layers_indices: list[int] = field(default_factory=lambda: [3, 7, 15, 23, 30])
    supported_aspect_ratios: list[list[int]] = field(default_factory=lambda: ASPECT_RATIOS_4)

    @property
    def patches_per_tile(self) -> int:
        """Visual tokens of one tile: the patch grid plus the class token (1,601 at 560 / 14)."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def num_patches(self) -> int:
        """Visual tokens of one video frame: lvx gives a frame one tile (the empty tiles beside it
        in the tower give no resident visual tokens; only the rows before the first frame attend
        to them, `header_visual_tokens_per_frame`)."""
        return self.patches_per_tile

    @property
    def tower_tokens_per_frame(self) -> int:
        """Tokens the tower runs for one frame: its tile and the empty tiles up to
        `max_num_tiles` the published processor pads it with, each padded to a multiple of 8
        (4 x 1,608 = 6,432 at 11B)."""
        return self.max_num_tiles * -(-self.patches_per_tile // 8) * 8

    @property
    def max_aspect_ratio_id(self) -> int:
        return len(self.supported_aspect_ratios)


@dataclass
class MllamaTextConfig:
    vocab_size: int = 128256
    hidden_size: int = 4096
    num_hidden_layers: int = 40
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 14336
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(LLAMA3_ROPE))
    max_position_embeddings: int = 131072
    cross_attention_layers: list[int] = field(
        default_factory=lambda: [3, 8, 13, 18, 23, 28, 33, 38]
    )
    tie_word_embeddings: bool = False
    bos_token_id: int = 128000
    eos_token_id: int | list[int] = field(default_factory=lambda: [128001, 128008, 128009])
    pad_token_id: int | None = 128004

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class MllamaConfig:
    vision: MllamaVisionConfig = field(default_factory=MllamaVisionConfig)
    text: MllamaTextConfig = field(default_factory=MllamaTextConfig)
    image_token_index: int = 128256

    # ---- the sizes the app's plans read, by their Hugging Face names (the text model's)
    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.text.intermediate_size

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.text.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.text.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.text.head_dim

    @property
    def num_kv_groups(self) -> int:
        return self.text.num_attention_heads // self.text.num_key_value_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def cross_layer_indices(self) -> list[int]:
        """0-based indices of the layers that attend to the frames (the cross-attention layers)."""
        return sorted(self.text.cross_attention_layers)

    @property
    def visual_feature_size(self) -> int:
        """Width of E: `multi_modal_projector` maps a visual token to the text width."""
        return self.text.hidden_size

    @property
    def cross_attention_heads(self) -> int:
        """Query heads of a cross layer (its `q_proj`, as built from the text config)."""
        return self.text.num_attention_heads

    @property
    def cross_kv_heads(self) -> int:
        """K/V heads of a cross layer's visual K/V (its `k_proj`, as built from the text config)."""
        return self.text.num_key_value_heads

    @property
    def cross_head_dim(self) -> int:
        return self.text.head_dim

    @property
    def visual_tokens_per_frame(self) -> int:
        """Visual keys one frame adds to every cross layer: one tile a frame."""
        return self.vision.num_patches

    @property
    def header_visual_tokens_per_frame(self) -> int:
        """Visual keys of a frame the rows before the first frame attend to: every tile's, the
        empty ones' included (transformers opens those rows to every key), held while they
        prefill."""
        return self.vision.max_num_tiles * self.vision.num_patches

    @property
    def vision_tokens_per_frame(self) -> int:
        """Tokens the vision tower runs for one frame (its cost; it keeps
        `visual_tokens_per_frame`)."""
        return self.vision.tower_tokens_per_frame

    @property
    def frame_size(self) -> int:
        return self.vision.image_size

    @property
    def frame_channels(self) -> int:
        return self.vision.num_channels

    @property
    def vision_hidden_size(self) -> int:
        return self.vision.hidden_size

    @property
    def vision_intermediate_size(self) -> int:
        return self.vision.intermediate_size

    @property
    def vision_layers(self) -> int:
        """The local layers and the gated global ones."""
        return self.vision.num_hidden_layers + self.vision.num_global_layers

    @property
    def vision_output_size(self) -> int:
        """The final output and the intermediate layers' outputs, concatenated (7,680)."""
        return self.vision.vision_output_dim

    @property
    def text_kv_layers(self) -> int:
        """The self-attention layers: a cross-attention layer keeps no text K/V."""
        return self.text.num_hidden_layers - len(self.text.cross_attention_layers)

    @property
    def prompt_header_tokens(self) -> int:
        return PROMPT_HEADER_TOKENS

    @property
    def prompt_positions_per_frame(self) -> int:
        """One `<|image|>` a frame."""
        return 1

    @property
    def visual_kv_chunk_bytes(self) -> int:
        """Float32 work of one chunk of frames while a cross layer's K/V are made."""
        return VISUAL_KV_CHUNK_BYTES

    @property
    def generation_name(self) -> str:
        """The checkpoint generation among the family's `generations`."""
        return GENERATION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MllamaConfig":
        """The published config.json's dict (unknown keys are ignored)."""
        text = dict(d.get("text_config", {}))
        rope = text.pop("rope_parameters", None)
        if rope:  # the newer form: theta inside the parameters
            text["rope_theta"] = rope.get("rope_theta", MllamaTextConfig.rope_theta)
            text["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
        return cls(
            vision=_pick(MllamaVisionConfig, d.get("vision_config", {})),
            text=_pick(MllamaTextConfig, text),
            image_token_index=int(d.get("image_token_index", 128256)),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "MllamaConfig":
        return cls.from_dict(checked_config(path))

    def to_dict(self) -> dict[str, Any]:
        """config.json as published (the keys transformers writes for Llama-3.2-Vision)."""
        vision = {f.name: getattr(self.vision, f.name) for f in fields(self.vision)}
        text = {f.name: getattr(self.text, f.name) for f in fields(self.text)}
        vision.update(model_type="mllama_vision_model", hidden_act="gelu")
        text.update(model_type="mllama_text_model", hidden_act="silu")
        return {
            "architectures": ["MllamaForConditionalGeneration"],
            "model_type": "mllama",
            "image_token_index": self.image_token_index,
            "torch_dtype": "bfloat16",
            "text_config": text,
            "vision_config": vision,
        }


def _pick(cls, d: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
