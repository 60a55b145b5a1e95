"""The video a rank holds: its frames' visual K/V (or features) and the prefilled video prompt.

Loading a video: ingest this rank's frames (decode and encode, or the feature cache), place the
subtitle lines at the sampled frames after them, open the visual K/V (read back, or computed and
maybe saved), then read back the saved video prompt or prefill it (the frames, each frame's
placeholder tokens on the rank holding the frame, then the subtitle block) into the conversation.
A question then only prefills its own tokens.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lvx_app.cache import PrefixCache, PrefixKey, SavedPrefix, VisualKVCache, VisualKVKey
from lvx_app.cache.fingerprints import fingerprint_memo
from lvx_app.config import MEDIA_ATTENTION, ModelConfig, VideoConfig
from lvx_app.devices import memory_report
from lvx_app.engine.conversation import Conversation
from lvx_app.engine.header_prefill import prefill_header
from lvx_app.engine.kv_choice import KvChoice, choose_kv_mode
from lvx_app.engine.memory_plan import ParamCounts, param_counts
from lvx_app.engine.records import (
    EngineError,
    EngineWarning,
    ProgressFn,
    VideoOpening,
    VideoRequest,
    VideoSummary,
)
from lvx_app.engine.resident_visual_kv import VisualKVChoice, VisualKVOpener
from lvx_app.engine.video_prompt import VideoPrompt, video_prompt
from lvx_app.parallel.collectives import all_min
from lvx_app.speech.sharded import Transcript, transcribe_video
from lvx_app.subtitles import Cue
from lvx_app.video.errors import VideoError
from lvx_app.video.ingest import Encoder, IngestTuning, VisualShard, ingest, rank_memory_budget
from lvx_models.api import family_of

# bump when the video prompt's prefill changes (positions, sharding) while its token ids do not;
# 2: every rank holds (and saves) the whole replicated text cache; 3: the rows before the first
# frame attend to the header features
PROMPT_FORMAT = 3


def oom_message(rank: int, device: torch.device, stage: str) -> str:
    """The one line a user sees when a rank runs out of GPU memory, with what to try."""
    return (
        f"rank {rank} ran out of GPU memory while {stage} ({memory_report(device)}); "
        "use more GPUs (--gpus), a lower --fps or --max-frames, or --kv-mode recompute"
    )


def request_cues(request: VideoRequest, info, progress: ProgressFn | None) -> Transcript:
    """The request's cues; a frontend sends them resolved, else they are found here (its notes as
    warnings from rank 0). When the request says so, the video's speech transcribed by the group
    (lvx_app/speech), its notes as warnings."""
    track = request.subtitle_track()
    notes = track.notes if request.cues is None else []
    found = Transcript(list(track.cues))
    if request.speech:
        try:
            found = transcribe_video(request.path, request.video, info.device, progress)
        except VideoError as exc:
            raise EngineError(str(exc)) from None
        notes = found.notes
    if info.rank == 0:
        for note in notes:
            warnings.warn(EngineWarning(note))
    return found


@dataclass(frozen=True)
class Identity:
    """What names the weights in the caches (empty when the caches are off)."""

    model_key: str  # the resolved checkpoint path (or hub id)
    encoder: str  # fingerprint of the vision tower and projector weights
    checkpoint: str  # fingerprint of every weight file


class WeightNames:
    """The loaded weights' names in the caches. Taken before the weights load, so that nothing is
    filed under weights newer than the model's; for an engine opened without the cache, at the
    first load that turns it on, if the checkpoint's files are still those it loaded."""

    def __init__(self, model: ModelConfig, video: VideoConfig) -> None:
        self.model = model
        self.family = family_of(model.path, model.revision)
        self.checkpoint = self.family.checkpoint_identity(model.path, model.revision)  # stats only
        self._named = self._name(video.cache_dir) if video.cache else None

    def of(self, video: VideoConfig) -> Identity:
        """The names a load with `video`'s options files its cache entries under."""
        if not video.cache:
            return Identity(self.model.path, "", "")
        if self._named is None:
            if (
                self.family.checkpoint_identity(self.model.path, self.model.revision)
                != self.checkpoint
            ):
                raise EngineError(
                    f"the checkpoint {self.model.path} changed on disk since it was loaded, so the "
                    "cache cannot name its weights; load without the cache, or open it again"
                )
            self._named = self._name(video.cache_dir)
        return self._named

    def _name(self, cache_dir: str | None) -> Identity:
        with fingerprint_memo(cache_dir) as memo:
            model_key, encoder = self.family.encoder_identity(
                self.model.path, self.model.revision, memo
            )
        return Identity(model_key, encoder, self.checkpoint)


@dataclass(frozen=True)
class LoadCaches:
    """The caches one load reads and writes, as its options say (`--cache`, `--cache-dir`,
    save_visual_kv)."""

    names: Identity
    prefixes: PrefixCache | None  # saved video prompts
    visual_kv: VisualKVOpener  # the visual K/V: read back, or computed and maybe saved


@dataclass
class LoadedVideo:
    """What a loaded video left on this rank."""

    summary: VideoSummary
    subtitle_block: str  # the subtitle text in the prefilled prompt ("" = none)
    prefix_ids: torch.Tensor  # the prompt prefilled at load
    kv_mode: str  # cache | recompute
    local_frames: int  # the frames this rank holds
    visual_kv: VisualKVChoice
    features: torch.Tensor | None  # E_local, kept only to recompute K/V
    # seconds of this rank's load steps, as `/stats` names them: its ingest (frames decoded,
    # encoded and saved, or read from the cache), the prompt's prefill (wall and this process's CPU)
    timings: dict[str, float]
    request: VideoRequest | None = None  # how it was asked for (its opening: what comes before it)
    visual: Any = None  # the conversation's visual inputs while it holds the video
    # the text K/V of the prompt's rows before the first frame, when they attended to what only
    # the load had (`header_visual_tokens_per_frame`): put back when the prompt is fed again
    header_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kv_choice: KvChoice | None = None  # how kv_mode was decided, with its figures

    @property
    def opening(self) -> VideoOpening:
        """What the conversation says before the video."""
        return self.request.opening if self.request is not None else VideoOpening()


def held_bytes(loaded: LoadedVideo | None, conversation: Conversation) -> int:
    """Bytes a loaded video holds on this rank (its features, resident visual K/V and text K/V),
    all freed when another replaces it."""
    if loaded is None:
        return 0
    held = [loaded.features]
    kv = getattr(loaded.visual, "kv", None)
    if loaded.kv_mode == "cache" and isinstance(kv, dict):
        held += [t for pair in kv.values() for t in pair]
    held += [t for layer in conversation.cache.layers for t in (layer.k, layer.v)]
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))


class VideoContext:
    """Loads a video onto this rank's `Conversation`; every rank calls `load` at the same point.
    Every choice about one video comes from its `VideoRequest`."""

    def __init__(
        self,
        model,
        processor,
        model_config: ModelConfig,
        conversation: Conversation,
        names: WeightNames,
        dtype: torch.dtype,
        memory_gib: float | None = None,
    ) -> None:
        self.model, self.processor, self.dtype = model, processor, dtype
        self.memory_gib = memory_gib  # --rank-memory-gib (None: what is free when it is needed)
        self.model_config = model_config
        self.conversation, self.names = conversation, names
        self.info = conversation.info
        self.loaded: LoadedVideo | None = None
        self._counts: ParamCounts | None = None  # the model's parameters, for the memory plan

    def _caches(self, video: VideoConfig) -> LoadCaches:
        """The caches of one load: those in `video.cache_dir`, or none with the cache off."""
        names = self.names.of(video)
        kv_store = VisualKVCache(video.cache_dir) if video.cache else None
        device = self.info.device
        opener = VisualKVOpener(
            self.model, kv_store, lambda v: all_min(v, device), video.save_visual_kv
        )
        return LoadCaches(names, PrefixCache(video.cache_dir) if video.cache else None, opener)

    def load(self, request: VideoRequest, progress: ProgressFn | None = None) -> VideoSummary:
        """Make the video resident and prefill its prompt (its opening, the video, the subtitle
        lines at the sampled frames); the feature cache never depends on the subtitles. The prompt
        is built and checked from the plan, before any frame is decoded."""
        t0, video, path = time.perf_counter(), request.video, request.path
        transcript = request_cues(request, self.info, progress)
        cues = transcript.cues
        caches = self._caches(video)
        made: list[VideoPrompt] = []
        shard = self._ingest(
            path,
            video,
            caches.names,
            progress,
            lambda plan: made.append(self._prompt(request, cues, plan)),
        )
        timings = {"ingest s": time.perf_counter() - t0}
        plan, n_frames = shard.plan, len(shard.plan)
        block, placed, dropped, prompt = made[-1]
        starts = torch.tensor(prompt.media_starts, dtype=torch.int64)
        prefix_ids = prompt.input_ids[: self._prefix_len(prompt, n_frames, block)]
        kv_choice = self._kv_choice(video.kv_mode, n_frames)
        kv_mode = kv_choice.mode
        visual, choice = self._open_visual_kv(caches, shard, starts, kv_mode, request)
        self.loaded = None  # from here on a failure leaves no video loaded
        conversation = self.conversation
        conversation.clear()
        conversation.show_video(visual)
        t_prefill, cpu_prefill = time.perf_counter(), time.process_time()
        tail_from = int(starts[-1]) + prompt.placeholder_len if n_frames else 0
        restored = self._open_prefix(caches, shard, request, prefix_ids, starts, tail_from)
        timings["video prompt prefill s"] = time.perf_counter() - t_prefill
        timings["video prompt prefill CPU s"] = time.process_time() - cpu_prefill
        summary = VideoSummary(
            path=str(path),
            frames=n_frames,
            fps=float(plan.fps),
            duration_s=float(plan.duration_s),
            visual_tokens=n_frames * self.model.config.visual_tokens_per_frame,
            from_cache=shard.from_cache,
            seconds=time.perf_counter() - t0,
            timestamps=[float(t) for t in plan.timestamps],
            subtitle_lines=placed,
            subtitles_dropped=dropped,
            prompt_from_cache=restored,
            prompt_tokens=len(prefix_ids),
            visual_kv_from_cache=choice.source == "read back",
            kv_choice=kv_choice.as_dict(),
            subtitle_source=transcript.source,
            transcript=transcript.cues if request.speech else [],
            transcript_from_cache=transcript.from_cache,
        )
        # in kv mode cache the K/V hold everything needed; E stays on disk in the feature cache
        features = shard.features if kv_mode == "recompute" else None
        self.loaded = LoadedVideo(
            summary, block, prefix_ids, kv_mode, shard.num_frames, choice, features, timings
        )
        self.loaded.request, self.loaded.visual = request, visual
        self.loaded.kv_choice, self.loaded.header_kv = kv_choice, self._header_kv(starts)
        return summary

    def _header_kv(self, starts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The prefilled prompt's text K/V of its rows before the first frame, when the family's
        header attends to more than the frames' K/V (`LoadedVideo.header_kv`)."""
        if not (starts.numel() and self.model.config.header_visual_tokens_per_frame):
            return None
        h = int(starts[0])
        return [(k[:, :h].clone(), v[:, :h].clone()) for k, v in self.conversation.cache.layer_kv()]

    def _prompt(self, request: VideoRequest, cues: Sequence[Cue], plan) -> VideoPrompt:
        """The video's prompt for `plan` with its subtitle lines placed (`video_prompt`)."""
        context = int(self.model.config.max_position_embeddings)
        return video_prompt(self.processor, context, request, cues, plan, self.info.rank)

    def _open_visual_kv(
        self, caches: LoadCaches, shard: VisualShard, starts, kv_mode: str, request: VideoRequest
    ):
        """The video's visual K/V (made, or read back) as `VisualKVOpener.open` gives them, with the
        frames a token attends to (`--media-attention`); running out of GPU memory there is the
        session's one line."""
        try:
            visual, choice = caches.visual_kv.open(
                shard,
                starts,
                self._visual_kv_key(shard, starts, caches.names),
                resident=kv_mode == "cache",
                video=request.path,
            )
            window = MEDIA_ATTENTION[request.video.media_attention]
            return replace(visual, window=window), choice
        except torch.cuda.OutOfMemoryError as exc:
            message = oom_message(self.info.rank, self.info.device, "making the visual K/V")
            raise RuntimeError(message) from exc

    def _ingest(self, path, video: VideoConfig, names: Identity, progress, planned) -> VisualShard:
        def report(p) -> None:
            progress("frames", p.done, p.total)

        encoder = Encoder(
            self.model.encode_frames,
            image_size=self.processor.image_size,
            model_id=names.model_key or self.model_config.path,
            revision=self.model_config.revision or "",
            fingerprint=names.encoder,
            prep=self.processor.frame_prep,
        )
        device = self.info.device
        budget = rank_memory_budget(device, self.memory_gib)
        try:
            return ingest(
                path,
                encoder,
                video,
                device=device,
                dtype=self.dtype,
                layout=self.conversation.layout,
                progress=report if progress is not None else False,
                planned=planned,
                tuning=IngestTuning(memory_budget_bytes=budget),
            )
        except VideoError as exc:
            raise EngineError(str(exc)) from None
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(oom_message(self.info.rank, device, "encoding frames")) from exc

    def _prefix_len(self, prompt, n_frames: int, block: str) -> int:
        """Tokens prefilled at load: up to the last frame, or with subtitles up to the block's end
        (not <|im_end|>)."""
        if not n_frames:
            return 0
        if not block:
            return int(prompt.media_starts[-1]) + prompt.placeholder_len
        if int(prompt.input_ids[-1]) != self.processor.stop_ids[0]:
            raise RuntimeError("the video prompt does not end with <|im_end|>")
        return int(prompt.input_ids.numel()) - 1

    def _kv_choice(self, mode: str, n_frames: int) -> KvChoice:
        """`--kv-mode`, or auto's choice (`kv_choice`) with the loaded video counted as freed;
        every rank runs the mode all can afford."""
        if self._counts is None and mode == "auto" and self.info.device.type == "cuda":
            self._counts = param_counts(self.model.config)
        info, replaced = self.info, held_bytes(self.loaded, self.conversation)
        choice = choose_kv_mode(
            mode, self.model.config, n_frames, info.world_size, self.dtype.itemsize, info.device,
            replaced=replaced, counts=self._counts,
        )  # fmt: skip
        everywhere = all_min(int(choice.mode == "cache"), info.device)
        return choice if everywhere else replace(choice, mode="recompute")

    def _visual_kv_key(
        self, shard: VisualShard, starts: torch.Tensor, names: Identity
    ) -> VisualKVKey | None:
        if shard.cache_key is None:
            return None
        return VisualKVKey.make(
            shard.cache_key,
            checkpoint=names.checkpoint,
            media_starts=starts,
            device=self.info.device.type,
            dtype=self.dtype,
        )

    def _open_prefix(
        self,
        caches: LoadCaches,
        shard: VisualShard,
        request: VideoRequest,
        prefix_ids: torch.Tensor,
        starts: torch.Tensor,
        tail_from: int,
    ) -> bool:
        """Read back the prompt K/V an earlier run saved (`SavedPrompts`); else prefill the
        prompt (its header on its own when the family's header sees more keys) and save it. True
        when read back."""
        saved = SavedPrompts(caches, shard, request, self.conversation)
        key = saved.key(prefix_ids)
        if saved.read_back(key, prefix_ids):
            return True
        header = int(starts[0]) if self.model.config.header_visual_tokens_per_frame else 0
        try:
            if header:
                self._prefill_header(saved, prefix_ids[:header])
            self.conversation.prefill(
                prefix_ids[header:], media_starts=starts - header, tail_from=tail_from - header
            )
        except torch.cuda.OutOfMemoryError as exc:
            where = "reading the prompt"
            raise RuntimeError(oom_message(self.info.rank, self.info.device, where)) from exc
        saved.save(key)
        return False

    def _prefill_header(self, saved: "SavedPrompts", ids: torch.Tensor) -> None:
        """The rows before the first frame (`prefill_header`: they attend to the frames' K/V and
        the header features the encode held, then dropped). Read back when saved from these
        features; with features read from the cache and no saved header, the frames are encoded
        again for it."""
        key, shard, request = saved.key(ids), saved.shard, saved.request
        if saved.read_back(key, ids):
            return
        features = shard.header_features
        if not all_min(int(features is not None), self.info.device):
            video, names = replace(request.video, cache=False), saved.caches.names
            features = self._ingest(request.path, video, names, None, lambda plan: None)
            features = features.header_features
        shard.header_features = None
        prefill_header(self.conversation, self.model, features, ids)
        saved.save(key)


@dataclass(frozen=True)
class SavedPrompts:
    """The saved text K/V of one load's prompts (the video prompt, its header alone), named by
    the load's features and the prompt's ids; read back only when every rank has them and the
    features came from the cache (they were made from those features)."""

    caches: LoadCaches
    shard: VisualShard
    request: VideoRequest
    conversation: Conversation

    def key(self, ids: torch.Tensor) -> PrefixKey | None:
        """Where the text K/V of the prompt `ids` are saved (None: the caches are off)."""
        if self.caches.prefixes is None or self.shard.cache_key is None:
            return None
        return PrefixKey.make(
            self.shard.cache_key,
            checkpoint=self.caches.names.checkpoint,
            prompt_format=PROMPT_FORMAT,
            prompt_ids=ids,
            device=self.conversation.info.device.type,
            owner=self.request.opening.owner,
            media_attention=self.request.video.media_attention,
        )

    def read_back(self, key: PrefixKey | None, ids: torch.Tensor) -> bool:
        """Restore the saved text K/V of the prompt `ids` into the conversation when they can be."""
        info = self.conversation.info
        saved = self.caches.prefixes.load(key, info.device, owner=info.rank == 0) if key else None
        if not all_min(int(saved is not None and self.shard.from_cache), info.device):
            return False
        self.conversation.restore(saved.layers, saved.key_positions, ids.tolist())
        return True

    def save(self, key: PrefixKey | None) -> None:
        """Save the conversation's text K/V under `key` (rank 0: every rank holds the same whole
        cache, one file for all; a failed write warns, once)."""
        conversation = self.conversation
        if key is None or conversation.info.rank != 0:
            return
        saved = SavedPrefix(conversation.cache.layer_kv(), conversation.key_positions())
        self.caches.prefixes.save(key, saved, video=Path(self.request.path).resolve())
