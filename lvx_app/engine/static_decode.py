"""One process's decode step on buffers that stay put, so it can be replayed as a CUDA graph or
compiled.

The eager step appends to the text cache at host-side offsets and plans its attention on the host;
a captured CUDA graph would replay both frozen. Here the fed token, its position, the count of keys
it sees and the next token live in device buffers: every layer writes its new K/V at that position
(`index_copy_`), text attention runs over the first `used` keys of the layer's buffer
(`attn_fwd_upto`: on a GPU in half precision the count bounds the flash kernel itself, no mask),
the visual attention is planned from host copies that hold for every decoded token (it sees every
frame; the model's `decode_step` takes that visual step bound once per answer, `_decode_visual`),
and the greedy next id is taken on the device. The step reads nothing on the host and
allocates the same every time; the host reads the next id once per token, as the eager loop does.
The text cache gets room for the whole answer before the first step (`TextKVCache.reserve`), its
unused tail zeroed (masked keys must hold finite values).

One `StaticDecode` serves a session (`Generator` keeps it): its capture, or its compiled step, is
reused by every later answer and follow-up while what it reads by address stays put (`_Bound`: the
text cache's buffers, the video). A new video, a cleared conversation, or a cache that must grow for
a longer answer makes the next answer capture again; when the cache grows it gets room for a
follow-up question and its answer too (`FOLLOW_UP_ROOM`).

`--compile-decode` runs the step through torch.compile (one process); `--cuda-graphs` runs two
steps eagerly on a side stream, captures the third and replays it from then on (CUDA only; the
compiled step when both are asked); `decode_step` reads them. On a group the step holds its
collectives, fixed in shape (the visual combine, on which the fed token and the stop flag ride to
every rank, `next_token_riding`): a graph captures them on NCCL, never on gloo, and every rank
replays its graph in step. Greedy answers only: sampling draws from a generator seeded per token on
the host.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lvx_app.attention.decode_xattn import CombineBuffers
from lvx_app.config import GenerationConfig, ModelConfig
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.parallelize import ShardedHooks
from lvx_app.engine.records import EngineWarning
from lvx_kernels.carry import Carry
from lvx_kernels.feed import REPLICATED, Feed
from lvx_kernels.kernels import attn_fwd_upto
from lvx_kernels.masks import Indices
from lvx_models.api import AttentionHooks, VisualStep

WARMUP_STEPS = 2  # eager steps before a CUDA graph is captured (lazy initialisation happens there)
# tokens of room reserved past an answer when the text cache must grow for it, so a follow-up
# question and its answer fit in the same buffers and the captured step holds for them
FOLLOW_UP_ROOM = 256
MIN_NCCL_FOR_GRAPHS = (2, 9, 6)  # the first NCCL whose collectives a CUDA graph captures


@dataclass(frozen=True)
class DecodeStep:
    """How one process runs a greedy decoded token: compiled, replayed as a CUDA graph, both, or
    neither (the eager loop)."""

    compiled: bool = False
    graphs: bool = False

    def used_for(self, generation: GenerationConfig) -> bool:
        """Whether an answer runs on `StaticDecode` (greedy, and something asked for)."""
        return (self.compiled or self.graphs) and generation.temperature <= 0


def decode_step(
    model: ModelConfig, device: torch.device, world: int, backend: str | None = None
) -> DecodeStep:
    """The options' decode step for this process; what cannot run here says so once. A group's
    step holds collectives (the visual combine, the token's agreement riding on it): a CUDA graph
    captures them on NCCL (2.9.6 on), never on gloo. `backend`: the group's (default: the
    initialised one's)."""
    if backend is None and world > 1 and dist.is_initialized():
        backend = dist.get_backend()
    why = _no_graphs(device, world, backend) if model.cuda_graphs else None
    if why is not None:
        warnings.warn(f"--cuda-graphs {why}; decoding runs without them", EngineWarning)
    if model.compile_decode and world > 1:
        warnings.warn("--compile-decode needs one process; decoding runs without it", EngineWarning)
    return DecodeStep(model.compile_decode and world == 1, model.cuda_graphs and why is None)


def _no_graphs(device: torch.device, world: int, backend: str | None) -> str | None:
    """Why a CUDA graph cannot hold this process's decode step, or None when it can."""
    if device.type != "cuda":
        return "needs a GPU"
    if world == 1:
        return None
    if backend != "nccl":
        return f"on several ranks need NCCL (this group runs {backend})"
    if nccl_version() < MIN_NCCL_FOR_GRAPHS:
        wanted = ".".join(map(str, MIN_NCCL_FOR_GRAPHS))
        return f"on several ranks need NCCL {wanted} or newer to capture collectives"
    return None


def nccl_version() -> tuple[int, ...]:
    """The NCCL this torch build runs (CUDA builds only)."""
    version = torch.cuda.nccl.version()
    return tuple(version) if isinstance(version, tuple) else (version,)


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

    def __init__(self, conversation: Conversation, how: DecodeStep, rides: bool = False) -> None:
        """`rides`: a group's step, whose first visual combine carries the fed token and the stop
        flag to every rank (`next_token_riding`)."""
        model, device = conversation.model, conversation.info.device
        self.conversation, self.how, self.model = conversation, how, model
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.used = torch.ones(1, dtype=torch.int32, device=device)  # keys seen: position + 1
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.next = torch.zeros((), dtype=torch.int64, device=device)
        self.q_vis = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.cache = _FixedCache(conversation, self.position)
        self.hooks = AttentionHooks(text=self._text, visual=_own_visual_hook(conversation))
        self.visual: VisualStep | None = None  # during an answer only (it holds the video's K/V)
        self.run: Callable[[], None] = torch.compile(self.step) if how.compiled else self.step
        self.graph = None
        self.steps = 0
        self._bound: _Bound | None = None
        self.ride = torch.zeros(2, dtype=torch.int64, device=device)  # (token, stop) on the device
        self.carry = Carry(self.ride, on_device=True) if rides else None
        self.feed = REPLICATED

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
            # without a video there is no visual combine to ride on (the _Bound holds the video)
            riding = self.carry is not None and self.visual is not None
            self.feed = Feed(carry=self.carry) if riding else REPLICATED
            self.position.fill_(cache.length)
            self.used.fill_(cache.length + 1)

    def finish(self) -> None:
        """The answer is over: let go of its video (a new one may load before the next answer)."""
        self.visual = None

    def _text(self, q, k, v, step, layer: int):
        return attn_fwd_upto(q, k, v, self.used, alibi=getattr(step, "alibi", None))

    @torch.inference_mode()
    def step(self) -> None:
        """One decoded token on the device: the fed token's K/V written at `position`, the next
        token's id into `next`, the position advanced."""
        if self.carry is not None:
            self.carry.received = None  # it rides on this step's first visual combine
        logits = self.model.decode_step(
            self.token,
            self.position.view(1, 1),
            hooks=self.hooks,
            cache=self.cache,
            visual_step=self.visual,
            feed=self.feed,
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

    @torch.inference_mode()
    def next_token_riding(self, token: int, stop: bool) -> tuple[list[list[int]], int]:
        """Feed `token` with this rank's stop flag riding on the step's first visual combine:
        (every rank's [token, stop] in rank order, this rank's greedy next token), read together
        once the step has run."""
        self.token.fill_(token)
        self.ride[0], self.ride[1] = token, int(stop)
        self._run_once()
        self.conversation.fed_in_place(token)
        return self.carry.received.tolist(), int(self.next)

    def take_back(self) -> None:
        """Take back the last token fed (its K/V stay in the buffer, unread: the next step writes
        over them)."""
        self.conversation.unfeed()
        length = self.conversation.cache.length
        self.position.fill_(length)
        self.used.fill_(length + 1)

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


def _own_visual_hook(conversation: Conversation):
    """The conversation's visual hook; on a group one whose combine buffers are the step's own
    (`copy` of the sharded attention): a question's combine makes the session's buffers again at
    its size, which a captured step must not read."""
    attn = conversation.attn
    if not isinstance(attn, ShardedHooks):
        return conversation.hooks.visual
    own = copy.copy(attn)
    own.buffers = CombineBuffers()
    return own.visual


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
