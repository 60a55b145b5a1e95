"""The record each model family exports (`lvx_models.api` lists them): what the app may ask of a
family without naming any of its parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Protocol

# Where a loaded video goes in a user message: every family's processor reads it there.
VIDEO = "<|video|>"


@dataclass(frozen=True)
class FramePrep:
    """How a family turns decoded video frames into the pixels its encoder takes, in two halves:
    `resize` runs in the decode worker processes (so it must pickle: a module-level function or a
    partial of one), `normalize` later on the encoder's device."""

    size: int  # S: the encoder takes pixel values (n, 3, S, S)
    resize: Callable[..., Any]  # (uint8 frames (n, H, W, 3), S) -> uint8 (n, 3, S, S)
    normalize: Callable[[Any], Any]  # uint8 (n, 3, S, S) -> float32 pixel values, same shape

    def pixel_values(self, frames: Any) -> Any:
        """Raw uint8 frames (n, H, W, 3) -> float32 pixel values (n, 3, S, S)."""
        return self.normalize(self.resize(frames, self.size)).contiguous()


class ModelConfig(Protocol):
    """A family's config (`Family.config_type`) as the app reads it: exactly these sizes, by their
    Hugging Face names where the language model has one, else by what they are for; nothing
    else of a config is the app's."""

    # the language model
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int: ...

    @property
    def num_kv_groups(self) -> int:
        """Query heads per K/V head."""

    @property
    def text_kv_layers(self) -> int:
        """Layers that keep text K/V (a layer that only attends to the frames keeps none)."""

    # the prompt
    @property
    def prompt_header_tokens(self) -> int:
        """Chat-template tokens of a video prompt before its first frame."""

    @property
    def prompt_positions_per_frame(self) -> int:
        """Prompt positions one frame takes (its placeholder; its visual tokens take none)."""

    # the frames
    @property
    def visual_tokens_per_frame(self) -> int:
        """Visual keys one frame adds to every cross layer."""

    @property
    def vision_tokens_per_frame(self) -> int:
        """Tokens the vision tower runs for one frame (padding included): its cost per frame."""

    @property
    def cross_layer_indices(self) -> list[int]:
        """0-based indices of the layers that attend to the frames."""

    @property
    def frame_size(self) -> int:
        """Side of the square image the vision tower takes, in pixels."""

    @property
    def frame_channels(self) -> int: ...

    @property
    def vision_hidden_size(self) -> int: ...

    @property
    def vision_intermediate_size(self) -> int: ...

    @property
    def vision_layers(self) -> int:
        """Layers the vision tower runs on a frame."""

    @property
    def vision_output_size(self) -> int:
        """Width of a visual token the projector takes (wider than the tower where it
        concatenates layers' outputs)."""

    @property
    def visual_kv_chunk_bytes(self) -> int:
        """Float32 work of one chunk of frames while a cross layer's K/V are made."""

    @property
    def generation_name(self) -> str:
        """The name of the checkpoint's generation among its family's `generations`."""


class Loaded(NamedTuple):
    """What a family's `load` returns."""

    model: Any
    config: Any
    processor: Any


@dataclass(frozen=True)
class Generation:
    """One published generation of a family's checkpoints: a record the app shows and passes on,
    never a string it compares."""

    family: str  # the family's name
    name: str  # what `lvx demo --generation` takes, e.g. "g2"
    note: str  # the releases it covers, in words
    default: bool = False  # the one a command uses when none is named


@dataclass(frozen=True)
class Family:
    """What the app may ask of one model family, without naming any of its parts.

    load(path, *, dtype, device, revision, fuse) -> (model, config, processor)
    inspect(path, revision) -> a record with `.path` and `.config` (headers read, no weights)
    describe(info) -> the rows `lvx info` shows for it
    read_config(folder) -> the config of a checkpoint folder (config.json only)
    write_tiny(directory, generation) -> a random-weight checkpoint in the published layout
    checkpoint_identity(path, revision) -> identity of every file (stats only)
    encoder_identity(path, revision, memo) -> (resolved path, fingerprint of the vision weights)
    parameter_counts(config) -> {vision, projector, language, embedding}: parameters by part,
        counted on the meta device (nothing allocated)
    save_weights(model, base, dtype) -> every key of a checkpoint in the published layout made from
        a finetuned `model` (adapters merged) and `base`, the checkpoint it was trained from; None:
        the family's models cannot be finetuned yet (its models then need not be `Finetunable`)
    """

    name: str
    title: str  # as users write it, e.g. "mPLUG-Owl3"
    model_types: tuple[str, ...]  # config.json `model_type` values of its checkpoints
    generations: tuple[Generation, ...]
    load: Callable[..., Any]
    inspect: Callable[..., Any]
    describe: Callable[[Any], dict[str, str]]
    read_config: Callable[[Path], Any]
    write_tiny: Callable[..., Path]
    checkpoint_identity: Callable[..., str]
    encoder_identity: Callable[..., tuple[str, str]]
    parameter_counts: Callable[[Any], dict[str, int]]
    config_type: type  # the class of its `config`
    save_weights: Optional[Callable[..., dict[str, Any]]] = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def default_generation(self) -> Generation:
        """The generation a command uses when none is named: the one marked so, else the first."""
        return next((g for g in self.generations if g.default), self.generations[0])

    def generation(self, name: str) -> Generation:
        for g in self.generations:
            if g.name == name:
                return g
        names = ", ".join(g.name for g in self.generations)
        raise ValueError(f"{self.title} generations are {names}, not {name!r}")


class Finetunable(Protocol):
    """What the training loop asks of a model whose family has `save_weights`, besides `forward`
    (with `hooks=`, `feed=`, `visual=`), `prepare_visual` and `encode_images`; of its processor it
    asks `training_prompt(messages, videos=) -> (prompt, [(start, end) of each answer's tokens
    that carry a loss])`, the template's own end tokens included."""

    def trainable_parameters(self, which: str) -> list[tuple[str, Any]]:
        """(name, parameter) of "hyper" (what makes the visual K/V, and any gate mixing them in),
        "all" (all but the vision tower) or "adapters" (what `wrap_linears` added)."""
        ...

    def projector_trains(self) -> bool: ...

    def lora_targets(self) -> Iterator[tuple[str, Any]]:
        """(name, Linear) an adapter may wrap."""
        ...

    def wrap_linears(self, factory: Callable[[Any], Any]) -> list[str]:
        """Replace each `lora_targets` Linear by `factory(linear)`, a module keeping it as `.base`
        with a `merged_weight()`."""
        ...

    vision_dtype: Any
    vision_device: Any

    def vision_features(self, pixel_values: Any) -> Any: ...

    def project(self, features: Any) -> Any: ...

    def visual_kv_parameters(self, layer: int) -> list[Any]:
        """The parameters a layer's visual K/V are made with (the recompute backward's targets)."""
        ...

    def checkpoint_layers(self, wrap: Callable[[Callable], Callable]) -> None: ...
