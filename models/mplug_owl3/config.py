"""Configuration of mPLUG-Owl3, parsed from the checkpoint's own `config.json`.

The json is the official HF layout (reference mplug_owl3.md §4): Qwen2 keys at the top level,
`hyper_layers` (1-based layer numbers) and a nested `vision_config` (SigLIP). It does not say which
architecture generation the weights are, nor which projector they use; the loader reads that from
the safetensors keys and passes it in:

- `generation`: "g1" (separate cross-attention + sigmoid gate; 7B-240728, 241014) or "g2" (one fused
  softmax; 7B-241101).
- `projector`: "linear" (`vision2text_model.{weight,bias}`) or "mlp" (`vision2text_model.{0,2}.*`).
- `gate_form` (G1 only): "proj", the input-dependent `self_attn.gate_proj` of the official 7B-240728
  code, or "channel", the constant per-channel `self_attn.gate` (the 1B/2B-241014 code). `form`
  names the three checkpoint generations as one label: "g1-gateproj", "g1", "g2" (`lvx demo
  --generation`).

A json value of the wrong type is refused with its field name, the value and the type expected.

Unknown json keys are kept in `extra` so `to_dict()` writes them back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ..config_checks import checked_config

Generation = Literal["g1", "g2"]
Projector = Literal["linear", "mlp"]
GateForm = Literal["channel", "proj"]
# checkpoint generation label -> (generation, G1 gate form)
FORMS: dict[str, tuple[Generation, GateForm]] = {
    "g1-gateproj": ("g1", "proj"),
    "g1": ("g1", "channel"),
    "g2": ("g2", "channel"),
}
NEWEST = "g2"  # the generation of the latest release, what `lvx demo` builds unless told
# what each label is, in one line (`lvx info --model`)
FORM_NOTES = {
    "g1-gateproj": "G1 as 7B-240728: separate cross-attention, input-dependent gate "
    "self_attn.gate_proj (per head)",
    "g1": "G1 as 1B/2B-241014: separate cross-attention, constant per-channel gate self_attn.gate",
    "g2": "G2 as 7B-241101: one fused softmax over visual and text keys, no gate",
}

# float32 working memory `visual_kv` may use at once without autograd (frames are projected in
# chunks this size).
VISUAL_KV_CHUNK_BYTES = 256 * 2**20
# The trained context of every released checkpoint; positions beyond it work (RoPE is computed on
# the fly) but the model never saw them, so the model warns once.
TRAINED_POSITIONS = 32768
# A video prompt's shape in positions: the chat template's tokens before the first frame (as
# bench_chat.py builds it), and the ids of one `<|image|>` placeholder (reference §5).
PROMPT_HEADER_TOKENS = 18
PLACEHOLDER_TOKENS = 5


def form_of(generation: str, gate_form: str) -> str:
    """The checkpoint generation label of a (generation, G1 gate form) pair (`FORMS` inverted)."""
    return "g1-gateproj" if generation == "g1" and gate_form == "proj" else generation


def split_form(form: str) -> tuple[Generation, GateForm]:
    """(generation, gate form) of a checkpoint generation label ("g1-gateproj", "g1" or "g2")."""
    if form not in FORMS:
        raise ValueError(f"generation must be one of {', '.join(FORMS)}, not {form!r}")
    return FORMS[form]


def _check_types(cls, known: dict[str, Any], where: str) -> None:
    """Refuse a json value of the wrong type by name (else it fails later with an unrelated
    message)."""
    want = {"int": int, "float": (int, float), "bool": bool, "str": str}
    for f in fields(cls):
        if f.name not in known or f.type not in want:
            continue
        v = known[f.name]
        if v is None and f.name.endswith("_token_id"):
            continue
        if not isinstance(v, want[f.type]) or (f.type in ("int", "float") and isinstance(v, bool)):
            raise ValueError(
                f"{where}{f.name} is {v!r} ({type(v).__name__}); expected "
                f"a{'n' * (f.type == 'int')} {f.type}"
            )


def _split(cls, d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    names = {f.name for f in fields(cls)} - {"extra"}
    return {k: v for k, v in d.items() if k in names}, {
        k: v for k, v in d.items() if k not in names
    }


@dataclass
class SiglipVisionConfig:
    """The `vision_config` block (SigLIP-so400m-patch14). Missing keys take the HF SigLIP
    defaults."""

    hidden_size: int = 1152
    image_size: int = 384
    intermediate_size: int = 4304
    model_type: str = "siglip_vision_model"
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    attention_dropout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    # keys the official config.json writes (the others are HF defaults and only written when not
    # default)
    _JSON_KEYS = (
        "hidden_size",
        "image_size",
        "intermediate_size",
        "model_type",
        "num_attention_heads",
        "num_hidden_layers",
        "patch_size",
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per side: 27 for both 384 and 378 (stride-14 conv without padding drops the
        remainder)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Visual tokens per image (729 for the released checkpoints)."""
        return self.grid**2

    @property
    def num_used_layers(self) -> int:
        """Encoder layers actually run: the output is `hidden_states[-2]`, after all but the last
        layer."""
        return self.num_hidden_layers - 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SiglipVisionConfig":
        known, extra = _split(cls, d)
        _check_types(cls, known, "vision_config.")
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        default = SiglipVisionConfig()
        out = {k: getattr(self, k) for k in self._JSON_KEYS}
        for f in fields(self):
            if (
                f.name not in out
                and f.name != "extra"
                and getattr(self, f.name) != getattr(default, f.name)
            ):
                out[f.name] = getattr(self, f.name)
        out.update(self.extra)
        return out


@dataclass
class Owl3Config:
    """mPLUG-Owl3 (HyperQwen2 language model + SigLIP tower + projector).

    `hyper_layers` is 1-based exactly as in config.json; use `hyper_layer_indices` for 0-based layer
    indices.
    """

    vocab_size: int = 151851
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = TRAINED_POSITIONS
    tie_word_embeddings: bool = False
    hyper_layers: list[int] = field(default_factory=lambda: [7, 15, 23, 26])
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    torch_dtype: str = "bfloat16"
    vision: SiglipVisionConfig = field(default_factory=SiglipVisionConfig)
    # not in config.json: filled by the loader from the checkpoint keys (reference §0 "Loader rule")
    generation: Generation = "g2"
    projector: Projector = "mlp"
    gate_form: GateForm = (
        "channel"  # G1 only: "proj" (7B-240728 gate_proj) or "channel" (self_attn.gate)
    )
    # every other json key (architectures, auto_map, sliding_window, ...), written back by to_dict()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.generation not in ("g1", "g2"):
            raise ValueError(f"generation must be 'g1' or 'g2', not {self.generation!r}")
        if self.projector not in ("linear", "mlp"):
            raise ValueError(f"projector must be 'linear' or 'mlp', not {self.projector!r}")
        if self.gate_form not in ("channel", "proj"):
            raise ValueError(f"gate_form must be 'channel' or 'proj', not {self.gate_form!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        bad = [l for l in self.hyper_layers if not 1 <= l <= self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"hyper_layers {bad} out of range 1..{self.num_hidden_layers} (they are 1-based)"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen2 uses 'silu')")

    # ---- derived
    # ----------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def form(self) -> str:
        """The checkpoint generation as one label: "g1-gateproj" (7B-240728), "g1" (241014) or "g2"
        (241101)."""
        return form_of(self.generation, self.gate_form)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def hyper_layer_indices(self) -> list[int]:
        """0-based indices of the hyper layers (layer i is one iff i+1 is in `hyper_layers`)."""
        return sorted(l - 1 for l in self.hyper_layers)

    def is_hyper(self, layer_idx: int) -> bool:
        return (layer_idx + 1) in self.hyper_layers

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches

    # ---- the sizes the app reads by generic names (`lvx_models.surface.ModelConfig`)
    # ----------------------------------------------------------------------------------------------
    @property
    def visual_tokens_per_frame(self) -> int:
        """Visual keys one frame adds to every cross layer (729 for the released checkpoints)."""
        return self.vision.num_patches

    # the tower runs for one frame exactly the tokens it keeps; the header sees the frames' keys
    vision_tokens_per_frame = visual_tokens_per_frame
    header_visual_tokens_per_frame = 0

    @property
    def cross_layer_indices(self) -> list[int]:
        """0-based indices of the layers that attend to the frames (the hyper layers)."""
        return self.hyper_layer_indices

    # the width of E (the projector maps a visual token to the language model's width), the query
    # heads of a hyper layer's visual attention (the text layer's `q_proj`)
    visual_feature_size = property(lambda self: self.hidden_size)
    cross_attention_heads = property(lambda self: self.num_attention_heads)

    @property
    def cross_kv_heads(self) -> int:
        """K/V heads of a hyper layer's visual K/V (`v_kv_proj`: the text layer's K/V heads)."""
        return self.num_key_value_heads

    cross_head_dim = property(lambda self: self.head_dim)

    @property
    def frame_size(self) -> int:
        """Side of the square image the vision tower takes, in pixels."""
        return self.vision.image_size

    frame_channels = property(lambda self: self.vision.num_channels)
    vision_hidden_size = property(lambda self: self.vision.hidden_size)
    vision_intermediate_size = property(lambda self: self.vision.intermediate_size)

    @property
    def vision_layers(self) -> int:
        return self.vision.num_used_layers

    @property
    def vision_output_size(self) -> int:
        return self.vision.hidden_size

    @property
    def text_kv_layers(self) -> int:
        """Every layer: a hyper layer attends to its text too."""
        return self.num_hidden_layers

    @property
    def prompt_header_tokens(self) -> int:
        """The chat template's tokens before the first frame's placeholder."""
        return PROMPT_HEADER_TOKENS

    @property
    def prompt_positions_per_frame(self) -> int:
        """Ids of one `<|image|>` placeholder in the released tokenizers (reference §5)."""
        return PLACEHOLDER_TOKENS

    @property
    def visual_kv_chunk_bytes(self) -> int:
        """Float32 work of one chunk of frames while a cross layer's K/V are made."""
        return VISUAL_KV_CHUNK_BYTES

    @property
    def generation_name(self) -> str:
        """The checkpoint generation the family's `generations` name (`form`)."""
        return self.form

    # ---- json
    # ----------------------------------------------------------------------------------------------
    _TOP_KEYS = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "hyper_layers",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
    )

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any],
        *,
        generation: Generation | None = None,
        projector: Projector | None = None,
        gate_form: GateForm | None = None,
    ) -> "Owl3Config":
        """Parse an official config.json dict. `generation`/`projector`/`gate_form` come from the
        checkpoint keys; when not given they default to the G2 pair ("g2", "mlp")."""
        d = dict(d)
        vision = SiglipVisionConfig.from_dict(d.pop("vision_config", None) or {})
        known = {k: d.pop(k) for k in cls._TOP_KEYS if k in d}
        if isinstance(
            known.get("eos_token_id"), list
        ):  # some configs list several; keep the json as is
            d["eos_token_id"] = known.pop("eos_token_id")
        _check_types(cls, known, "")
        if "hyper_layers" in known:
            layers = known["hyper_layers"]
            if not isinstance(layers, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in layers
            ):
                raise ValueError(
                    f"hyper_layers is {layers!r}; expected a list of ints (1-based layer numbers)"
                )
        kw: dict[str, Any] = {}
        if generation is not None:
            kw["generation"] = generation
        if projector is not None:
            kw["projector"] = projector
        if gate_form is not None:
            kw["gate_form"] = gate_form
        return cls(**known, vision=vision, extra=d, **kw)

    @classmethod
    def from_json(cls, path: str | Path, **kw: Any) -> "Owl3Config":
        return cls.from_dict(checked_config(path), **kw)

    def to_dict(self) -> dict[str, Any]:
        """The official config.json layout (no `generation`/`projector`/`gate_form`: those live in
        the weights)."""
        out: dict[str, Any] = {
            "architectures": ["mPLUGOwl3Model"],
            "auto_map": {
                "AutoConfig": "configuration_mplugowl3.mPLUGOwl3Config",
                "AutoModel": "modeling_mplugowl3.mPLUGOwl3Model",
                "AutoModelForCausalLM": "modeling_mplugowl3.mPLUGOwl3Model",
            },
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "mplugowl3",
            "sliding_window": self.max_position_embeddings,
            "transformers_version": "4.41.2",
            "use_cache": True,
            "use_sliding_window": False,
        }
        out.update({k: getattr(self, k) for k in self._TOP_KEYS})
        out["hyper_layers"] = list(self.hyper_layers)
        out.update(self.extra)
        out["vision_config"] = self.vision.to_dict()
        # official order: architectures, auto_map, the rest alphabetically, then hyper_layers,
        # vision_config
        rank = {"architectures": -2, "auto_map": -1, "hyper_layers": 1, "vision_config": 2}
        return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], 0), kv[0])))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
