"""What a model family provides, written down: the record it exports (`Family`, listed in
`lvx_models.api`), the model its `load` returns (`VideoModel`), that model's config (`ModelConfig`),
its processor (`Processor`) and the prompt record every processor makes (`Prompt`); finetuning asks
`Finetunable` of a model whose family can save weights. `protocol_gaps` checks an object against a
Protocol (methods present with compatible signatures), as the conformance test does for every
registered family."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Protocol, Sequence

import torch

from .safetensors_folder import safetensors_files

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
    def header_visual_tokens_per_frame(self) -> int:
        """Visual keys of a frame the rows before the first frame attend to when those are more
        than its own: its own and those of `encode_frames`' header features; 0: its own only."""

    @property
    def vision_tokens_per_frame(self) -> int:
        """Tokens the vision tower runs for one frame (padding included): its cost per frame."""

    @property
    def cross_layer_indices(self) -> list[int]:
        """0-based indices of the layers that attend to the frames."""

    @property
    def cross_attention_heads(self) -> int:
        """Query heads of a cross layer's attention to the frames (its own geometry: it need not be
        the text layers' `num_attention_heads`)."""

    @property
    def cross_kv_heads(self) -> int:
        """K/V heads of a cross layer's visual K/V (its own geometry: it need not be the text
        layers' `num_key_value_heads`)."""

    @property
    def cross_head_dim(self) -> int:
        """Size of one head of a cross layer's visual K/V."""

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
    def visual_feature_size(self) -> int:
        """Width of a visual feature E, what the projector (or resampler) hands the cross layers
        to make their K/V from."""

    @property
    def visual_kv_chunk_bytes(self) -> int:
        """Float32 work of one chunk of frames while a cross layer's K/V are made."""

    @property
    def generation_name(self) -> str:
        """The name of the checkpoint's generation among its family's `generations`."""


@dataclass
class Prompt:
    """A tokenized chat prompt, as every family's processor makes it and the engine reads it.
    Positions are absolute: `offset` is where `input_ids[0]` sits in the conversation."""

    input_ids: torch.Tensor  # (L,) int64
    media_starts: list[int]  # the position of each image's or frame's placeholder, in order
    text: str  # the prompt text the ids were made from
    offset: int = 0
    placeholder_len: int = 1  # ids per placeholder (read from the tokenizer, never assumed)
    # the images and videos the prompt holds, each with its `pixel_values` (None: a video given as
    # a frame count) and what its family records of it
    media: list[Any] = field(default_factory=list)

    @property
    def num_placeholders(self) -> int:
        return len(self.media_starts)

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """All images' and frames' pixel values in placeholder order, or None if any video came as
        a count."""
        if not self.media or any(m.pixel_values is None for m in self.media):
            return None
        return torch.cat([m.pixel_values for m in self.media])


class Tokenizer(Protocol):
    """What the app asks of a processor's tokenizer."""

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (the question's character cap)."""
        ...


class TextStream(Protocol):
    """An answer's text as its tokens come (`Processor.stream`)."""

    def push(self, token_ids: Any) -> str: ...

    def flush(self) -> str: ...


class Processor(Protocol):
    """A family's processor (the third of what `load` returns): chat prompts with the places of
    the visual tokens, the frames' preparation, the ids that end an answer, streaming decode.
    `messages` are [{"role", "content"}]; a user message's `VIDEO` marks where the k-th of
    `videos` goes (its frame count: the engine makes the pixels)."""

    tokenizer: Tokenizer
    image_size: int  # side of the square pixels a frame becomes
    max_new_tokens: Optional[int]  # the checkpoint's own answer length, if it names one

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end an answer; the first closes a turn."""
        ...

    @property
    def frame_prep(self) -> FramePrep: ...

    def encode(self, text: str) -> list[int]:
        """Template text: special tokens written in it become their ids."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Text a user wrote: plain text, a special token typed in it included."""
        ...

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str: ...

    def stream(self) -> TextStream: ...

    def build_chat_prompt(
        self,
        messages: Sequence[dict],
        *,
        images: Sequence = (),
        videos: Sequence = (),
        cut: bool = True,
        add_generation_prompt: bool = True,
    ) -> Prompt:
        """A conversation from its start, in the checkpoint's template."""
        ...

    def build_followup(
        self,
        content: str,
        *,
        offset: int,
        images: Sequence = (),
        videos: Sequence = (),
        cut: bool = True,
    ) -> Prompt:
        """The ids after an answer that ended with `stop_ids[0]`, for the next user turn."""
        ...

    def build_continuation(self, messages: Sequence[dict], *, offset: int) -> Prompt:
        """The ids after such an answer for the next messages (text only)."""
        ...

    def training_prompt(
        self, messages: Sequence[dict], *, videos: Sequence = ()
    ) -> tuple[Prompt, list[tuple[int, int]]]:
        """(a conversation through its last assistant message, [start, end) of each answer's
        tokens that carry a loss, the template's own end tokens included)."""
        ...


class VideoModel(Protocol):
    """The model the engine runs (the first of what `load` returns): frames to visual features,
    the cross layers' K/V of the frames a process holds, and a text forward that calls the
    attention it is handed. Shapes and the records passed are `lvx_models.steps`' (`VisualInputs`,
    `VisualStep`, `TextKVCache`, `AttentionHooks`, `Feed`)."""

    config: Any  # a `ModelConfig`
    hooks: Any  # the `AttentionHooks` a forward handed none calls

    def encode_images(self, pixel_values: torch.Tensor, batch_size: Optional[int] = None) -> Any:
        """Pixel values (N, C, S, S) -> visual features E (N, visual tokens, hidden)."""
        ...

    def encode_frames(self, pixel_values: torch.Tensor, batch_size: Optional[int] = None) -> Any:
        """Video frames (N, C, S, S) -> `FrameFeatures`: E, and the header features the rows
        before the first frame attend to besides E when the config's
        `header_visual_tokens_per_frame` says there are more keys."""
        ...

    def visual_kv(self, layer_idx: int, e_local: torch.Tensor, frame_positions: Any) -> Any:
        """A cross layer's (K, V), each (1, N * tokens, kv heads, head size), of the frames in
        e_local; a pure function of the weights and E."""
        ...

    def visible_frames(self, positions: torch.Tensor, media_starts: torch.Tensor) -> Any:
        """How many frames each token at `positions` sees (q_vis)."""
        ...

    def prepare_visual(
        self,
        e_local: torch.Tensor,
        media_starts: torch.Tensor,
        frame_ids: Optional[torch.Tensor] = None,
        *,
        precompute: bool = True,
    ) -> Any:
        """The `VisualInputs` of the frames this process holds (every cross layer's K/V now, or
        made from E when a layer runs)."""
        ...

    def fuse_projections(self) -> None:
        """Fuse what a forward without autograd may run fused (the loader calls it)."""
        ...

    def new_cache(self) -> Any:
        """An empty `TextKVCache` for every layer."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Any = None,
        visual: Any = None,
        last_only: bool = False,
        feed: Any = None,
        hooks: Any = None,
    ) -> torch.Tensor:
        """Logits (1, L, V) ((1, 1, V) with last_only) of input_ids (1, L) after the cache."""
        ...

    def decode_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        hooks: Any,
        cache: Any,
        visual_step: Any,
        feed: Any = None,
    ) -> torch.Tensor:
        """One decoded token's logits (1, 1, V) with its `VisualStep` already bound (the step a
        CUDA graph captures)."""
        ...


def _parameters(fn: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _signature_gaps(name: str, want: Any, have: Any) -> list[str]:
    """Why `have` cannot be called every way the Protocol's `want` may be: a parameter missing,
    of another kind, out of order, without the default the Protocol gives, or an extra one
    without a default."""
    if not callable(have):
        return [f"{name} is not callable"]
    try:
        got = {p.name: p for p in _parameters(have)}
    except (TypeError, ValueError):
        return []  # a builtin without a signature: nothing to compare
    if any(p.kind is p.VAR_KEYWORD for p in got.values()):
        return []
    gaps, order = [], [p.name for p in got.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    wanted = _parameters(want)
    for i, p in enumerate(wanted):
        q = got.get(p.name)
        if q is None:
            gaps.append(f"{name} lacks parameter {p.name!r}")
        elif q.kind is not p.kind:
            gaps.append(f"{name}: {p.name!r} is {q.kind.description}, not {p.kind.description}")
        elif p.kind is p.POSITIONAL_OR_KEYWORD and order.index(p.name) != i:
            gaps.append(f"{name}: {p.name!r} is not parameter {i + 1}")
        elif p.default is not p.empty and q.default is q.empty:
            gaps.append(f"{name}: {p.name!r} has no default")
    names = {p.name for p in wanted}
    extra = [q.name for q in got.values() if q.name not in names and q.default is q.empty]
    extra = [n for n in extra if got[n].kind not in (got[n].VAR_POSITIONAL,)]
    gaps += [f"{name}: extra parameter {n!r} has no default" for n in extra]
    return gaps


def protocol_gaps(obj: Any, protocol: type) -> list[str]:
    """What `obj` lacks of `protocol`: its attributes and properties present, its methods present
    with signatures every call the Protocol allows fits (empty: it conforms)."""
    gaps = []
    names = set(getattr(protocol, "__annotations__", {}))
    for name, member in vars(protocol).items():
        if not name.startswith("_") and (callable(member) or isinstance(member, property)):
            names.add(name)
    for name in sorted(names):
        if not hasattr(obj, name):
            gaps.append(f"{type(obj).__name__} lacks {name}")
            continue
        member = vars(protocol).get(name)
        if callable(member) and not isinstance(member, property):
            gaps += _signature_gaps(f"{type(obj).__name__}.{name}", member, getattr(obj, name))
    return gaps


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
class Deferred:
    """`module.name` called, imported on the first call: a family's record names its loader and
    modeling code this way, so the registry imports them only when that family is used."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


@dataclass(frozen=True)
class Family:
    """What the app may ask of one model family, without naming any of its parts.

    load(path, *, dtype, device, revision, fuse) -> (model, config, processor)
    inspect(path, revision) -> a record with `.path` and `.config` (headers read, no weights)
    describe(info) -> the rows `lvx info` shows for it
    read_config(folder) -> the config of a checkpoint folder (its config files, no weights)
    write_tiny(directory, generation) -> a random-weight checkpoint in the published layout
    checkpoint_identity(path, revision) -> identity of every file (stats only)
    encoder_identity(path, revision, memo) -> (resolved path, fingerprint of the vision weights)
    parameter_counts(config) -> {vision, projector, language, embedding}: parameters by part,
        counted on the meta device (nothing allocated)
    hub_files: the files of a hub repo the family reads (glob patterns, `snapshot_download`'s)
    weight_files(folder) -> {key: the file holding it} of every tensor the family loads from a
        local checkpoint folder, read from headers (safetensors) or memory-mapped (PyTorch files,
        `torch_files`); the fit check sizes the weights by it, `encoder_identity` may hash by it
    published: the published checkpoints' configs (`config_type`, sizes only) by release name, the
        first the one a plan, a benchmark or the GPU acceptance uses when none is named
    marker_files: the files at the top of a checkpoint folder or hub repo that mark the family's
        checkpoints when they have no config.json naming a `model_type` (all of them present);
        empty: its checkpoints always have one
    save_weights(model, base, dtype) -> every key of a checkpoint in the published layout made from
        a finetuned `model` (adapters merged) and `base`, the checkpoint it was trained from; None:
        the family's models cannot be finetuned yet (its models then need not be `Finetunable`)
    finetuned_file: the file of a finetuned checkpoint folder `save_weights`' keys go to
        (`.safetensors`: a safetensors file, else the tensors `torch.save`d)
    finetuned_replaces: the files of the source checkpoint (glob patterns) that file replaces; a
        finetuned folder holds every other file of the source, copied
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
    hub_files: tuple[str, ...]
    save_weights: Optional[Callable[..., dict[str, Any]]] = None
    marker_files: tuple[str, ...] = ()
    published: Mapping[str, Any] = field(default_factory=dict)
    weight_files: Callable[[Path], dict[str, Path]] = safetensors_files
    finetuned_file: str = "model.safetensors"
    finetuned_replaces: tuple[str, ...] = ("*.safetensors", "model.safetensors.index.json")
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
