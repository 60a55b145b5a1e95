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


# A family's config (`Family.config_type`): the sizes the app's plans read, by their Hugging Face
# names (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, ...).
ModelConfig = Any


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
