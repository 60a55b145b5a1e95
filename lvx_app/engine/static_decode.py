"""One process's decode step on buffers that stay put, so it can be replayed as a CUDA graph or
compiled.

The eager step appends to the text cache at host-side offsets and plans its attention on the host;
a captured CUDA graph would replay both frozen. Here the fed token, its position, the count of keys
it sees and the next token live in device buffers: every layer writes its new K/V at that position
(`index_copy_`), text attention runs over the first `used` keys of the layer's buffer
(`attn_fwd_upto`: on a GPU in half precision the count bounds the flash kernel itself, no mask),
the visual attention is planned from host copies that hold for every decoded token (it sees every
frame), and the greedy next id is taken on the device. The step reads nothing on the host and
allocates the same every time; the host reads the next id once per token, as the eager loop does.
The text cache gets room for the whole answer before the first step (`TextKVCache.reserve`), its
unused tail zeroed (masked keys must hold finite values).

One `StaticDecode` serves a session (`Generator` keeps it): its capture, or its compiled step, is
reused by every later answer and follow-up while what it reads by address stays put (`_Bound`: the
text cache's buffers, the video). A new video, a cleared conversation, or a cache that must grow for
a longer answer makes the next answer capture again; when the cache grows it gets room for a
follow-up question and its answer too (`FOLLOW_UP_ROOM`).

`--compile-decode` runs the step through torch.compile; `--cuda-graphs` runs two steps eagerly on a
side stream, captures the third and replays it from then on (CUDA only; the compiled step when both
are asked); `decode_step` reads them. One process and greedy answers
only: the ranks of a group agree on each token inside the step's collective, and sampling draws from
a generator seeded per token on the host.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from lvx_app.attention.kernels import attn_fwd_upto
from lvx_app.attention.masks import Indices
from lvx_app.config import GenerationConfig, ModelConfig
from lvx_app.engine.api import EngineWarning
from lvx_app.engine.conversation import Conversation
from lvx_models.mplug_owl3.hyper import VisualStep
from lvx_models.mplug_owl3.qwen2 import AttentionHooks

WARMUP_STEPS = 2  # eager steps before a CUDA graph is captured (lazy initialisation happens there)
# tokens of room reserved past an answer when the text cache must grow for it, so a follow-up
# question and its answer fit in the same buffers and the captured step holds for them
FOLLOW_UP_ROOM = 256


@dataclass(frozen=True)
class DecodeStep:
    """How one process runs a greedy decoded token: compiled, replayed as a CUDA graph, both, or
    neither (the eager loop)."""

    compiled: bool = False
    graphs: bool = False

    def used_for(self, generation: GenerationConfig) -> bool:
        """Whether an answer runs on `StaticDecode` (greedy, and something asked for)."""
        return (self.compiled or self.graphs) and generation.temperature <= 0


def decode_step(model: ModelConfig, device: torch.device, world: int) -> DecodeStep:
    """The options' decode step for this process; what cannot run here says so once."""
    graphs = model.cuda_graphs and device.type == "cuda" and world == 1
    if model.cuda_graphs and not graphs:
        warnings.warn(
            "--cuda-graphs needs one process on a GPU; decoding runs without them", EngineWarning
        )
    if model.compile_decode and world > 1:
        warnings.warn("--compile-decode needs one process; decoding runs without it", EngineWarning)
    return DecodeStep(model.compile_decode and world == 1, graphs)


class _FixedCache:
    """The conversation's text cache as a decode step on fixed buffers sees it: a layer's new K/V
    are written at the device-side `position`, and attention gets the layer's whole buffer."""

    def __init__(self, conversation: Conversation, position: torch.Tensor) -> None:
        self.conversation, self.position = conversation, position

    @property
    def length(self) -> int:
        return self.conversation.cache.length

    def truncate(self, length: int) -> None:
        """Nothing to cut: the host keeps the lengths (`StaticDecode.next_token`)."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        layer = self.conversation.cache.layers[layer_idx]
        layer.k.index_copy_(1, self.position, k.detach())
        layer.v.index_copy_(1, self.position, v.detach())
        return layer.k, layer.v


class StaticDecode:
    """The greedy decode step of one process's `Conversation`, run as `how` says (module
    docstring); one per session, its capture reused by every answer it still holds for
    (`start`)."""

    def __init__(self, conversation: Conversation, how: DecodeStep) -> None:
        model, device = conversation.model, conversation.info.device
        self.conversation, self.how, self.lm = conversation, how, model.language_model
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.used = torch.ones(1, dtype=torch.int32, device=device)  # keys seen: position + 1
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.next = torch.zeros((), dtype=torch.int64, device=device)
        self.q_vis = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.cache = _FixedCache(conversation, self.position)
        self.hooks = AttentionHooks(text=self._text, visual=model.hooks.visual)
        self.visual: VisualStep | None = None  # during an answer only (it holds the video's K/V)
        self.run: Callable[[], None] = torch.compile(self.step) if how.compiled else self.step
        self.graph = None
        self.steps = 0
        self._bound: _Bound | None = None

    def start(self, tokens: int) -> None:
        """Ready the step for an answer of up to `tokens` more tokens. The capture holds while the
        step's buffers stay put: the same text cache buffers with room for the answer, the same
        video. A new video, a cleared or grown cache invalidates it: the next answer captures again,
        with room for a follow-up question and its answer reserved past this one."""
        cache = self.conversation.cache
        with torch.inference_mode():  # the cache's buffers are inference tensors
            if not _has_room(cache, tokens):
                cache.reserve(tokens + FOLLOW_UP_ROOM)
            bound = _Bound.of(self.conversation)
            if self._bound is None or not self._bound.same(bound):
                for layer in cache.layers:  # masked keys must hold finite values
                    layer.k[:, layer.length :].zero_()
                    layer.v[:, layer.length :].zero_()
                self._bound, self.graph, self.steps = bound, None, 0
            self.visual = _decode_visual(self.conversation.visual, self.q_vis)
            self.position.fill_(cache.length)
            self.used.fill_(cache.length + 1)

    def finish(self) -> None:
        """The answer is over: let go of its video (a new one may load before the next answer)."""
        self.visual = None

    def _text(self, q, k, v, step, layer: int):
        return attn_fwd_upto(q, k, v, self.used)

    @torch.inference_mode()
    def step(self) -> None:
        """One decoded token on the device: the fed token's K/V written at `position`, the next
        token's id into `next`, the position advanced."""
        logits = self.lm(
            self.token,
            self.position.view(1, 1),
            hooks=self.hooks,
            cache=self.cache,
            visual=self.visual,
            last_only=True,
        )
        self.next.copy_(logits[0, -1].argmax())
        self.position.add_(1)
        self.used.add_(1)

    @torch.inference_mode()
    def next_token(self, token: int) -> int:
        """Feed `token` and return the greedy next token (the step's one host read)."""
        self.token.fill_(token)
        self._run_once()
        self.conversation.fed_in_place(token)
        return int(self.next)

    def _run_once(self) -> None:
        if not self.how.graphs:
            self.run()
        elif self.graph is not None:
            self.graph.replay()
        elif self.steps < WARMUP_STEPS:
            _on_side_stream(self.run)
        else:
            self.graph = _capture(self.run)
            self.graph.replay()
        self.steps += 1


def _has_room(cache, tokens: int) -> bool:
    """Whether every layer's buffer holds `tokens` more tokens in place."""
    return all(
        layer.k is not None and layer.length + tokens <= layer.k.shape[1] for layer in cache.layers
    )


@dataclass(frozen=True)
class _Bound:
    """What a captured step reads by address: the text cache's buffers and the video (held weakly,
    so a video or cache let go of is freed, and a new one never passes for it)."""

    cache: weakref.ref
    buffers: tuple
    visual: Callable[[], object]

    @staticmethod
    def of(conversation: Conversation) -> _Bound:
        visual = conversation.visual
        return _Bound(
            weakref.ref(conversation.cache),
            tuple(
                (t.data_ptr(), tuple(t.shape), t.stride())
                for layer in conversation.cache.layers
                for t in (layer.k, layer.v)
            ),
            (lambda: None) if visual is None else weakref.ref(visual),
        )

    def same(self, other: _Bound) -> bool:
        return (
            self.cache() is other.cache()
            and self.buffers == other.buffers
            and self.visual() is other.visual()
        )


def _decode_visual(visual, q_vis: torch.Tensor) -> VisualStep | None:
    """A decoded token's visual step: every frame visible, and the host knows it. `q_vis` (1, 1):
    the step's own buffer, so a capture reads the same one every answer."""
    if visual is None or visual.num_frames == 0:
        return None
    frames = visual.num_frames
    q_vis.fill_(frames)
    return VisualStep(visual.kv, visual.k_frame, Indices(q_vis, frames, frames))


def _on_side_stream(fn: Callable[[], None]) -> None:
    """Run `fn` on a side stream, ordered after and before the current one (how a step runs before
    its capture, as PyTorch's CUDA graph notes ask)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


def _capture(fn: Callable[[], None]):
    """`fn` captured as one CUDA graph (recorded, not run)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
