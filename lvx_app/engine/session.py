"""One video and one conversation, held by every rank of the group (SPMD).

Every rank loads the language model, encodes only its own frames (dealt by `SessionConfig.layout`,
lvx_app/parallel/layout.py), keeps their visual K/V (or recomputes them from one copy of E), and
holds the whole text K/V cache (replicated after each sharded prefill). A turn is a prefill (sharded
through LV-XAttn rings — the video prompt's tokens travel with their frames, a long question is cut
into contiguous runs — or whole on every rank when the question is short), then token-by-token
decoding where every rank runs the same one-token step (text attention local, one collective per
hyper layer); the ranks agree on rank 0's token inside the next step's first collective, not in one
of their own.

The prompt up to the last frame placeholder is prefilled when the video is loaded, so a question
only prefills its own few tokens.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from lvx_app.attention import Carry
from lvx_app.defaults import (
    DEFAULT_DECODE_TIMEOUT_S,
    DEFAULT_MODEL,
    DEFAULT_SUBTITLE_TOKENS,
    DEFAULT_TIMEOUT_S,
)
from lvx_app.devices import memory_report, resolve_dtype
from lvx_app.engine.api import (
    AnswerStats,
    EngineError,
    EngineWarning,
    GenerationParams,
    ProgressFn,
    QuestionTooLong,
    VideoSummary,
)
from lvx_app.engine.generation import LoopOutcome, never_stop, token_loop
from lvx_app.engine.hooks import ShardedAttention
from lvx_app.engine.limits import PrefillShape, question_limit, too_long
from lvx_app.engine.visual_kv import VisualKVChoice, VisualKVOpener, kv_nbytes
from lvx_app.parallel.collectives import nbytes
from lvx_app.parallel.group import DistInfo
from lvx_app.parallel.layout import DEFAULT_LAYOUT, check_layout, token_owners
from lvx_app.parallel.shards import shard_bounds
from lvx_app.subtitles import Cue, fit_lines, select_lines, subtitle_block
from lvx_app.video.cache import encoder_identity
from lvx_app.video.errors import VideoError, VideoWarning
from lvx_app.video.ingest import VisualShard, auto_memory_budget, ingest
from lvx_app.video.prefix_cache import PrefixCache, PrefixKey, SavedPrefix
from lvx_app.video.visual_kv_cache import VisualKVCache, VisualKVKey
from lvx_models.mplug_owl3.checkpoint import CheckpointError
from lvx_models.mplug_owl3.fingerprint import checkpoint_identity
from lvx_models.mplug_owl3.loader import load_model


@dataclass
class SessionConfig:
    """Everything a rank needs to build its session; travels to torchrun workers as JSON."""

    model: str = DEFAULT_MODEL
    revision: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    cuda: bool = False
    kv_mode: str = "auto"  # cache | recompute | auto (cache when it fits)
    fps: float = 1.0
    max_frames: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    cache: bool = True
    cache_dir: str | None = None
    decode_workers: int | None = None
    # a decode chunk that takes longer is killed and retried frame by frame
    decode_timeout_s: float = DEFAULT_DECODE_TIMEOUT_S
    subtitle_tokens: int = (
        DEFAULT_SUBTITLE_TOKENS  # most tokens the subtitle block of the video prompt may take
    )
    # benchmarks only: "ring" (pass-KV) or "allgather" run the same chat on a baseline
    attention: str = "lv_xattn"
    xattn_schedule: str = (
        "auto"  # a question's prefill: auto | ring | gather (see lvx_app.attention.schedule)
    )
    # contiguous | striped | zigzag: which frames, and video-prompt tokens, each rank holds
    layout: str = DEFAULT_LAYOUT
    save_visual_kv: str = (
        "auto"  # auto (when computing them measured slower than reading back) | always | never
    )


def _video_text(block: str, question: str = "") -> str:
    """The first user turn: the video, the subtitle block (the text the eval prompt starts with),
    the question."""
    if not block:
        return "<|video|>\n" + question
    return "<|video|>\n" + block + "\n" + question.lstrip()


# bump when the video prompt's prefill changes (positions, sharding) while its token ids do not;
PROMPT_FORMAT = 2
# 2: every rank holds (and saves) the whole replicated text cache


class Session:
    """This rank's share of the engine. Every method is called on every rank in the same order."""

    def __init__(self, config: SessionConfig, info: DistInfo) -> None:
        self.config, self.info = config, info
        self.device = info.device
        try:
            self.dtype = resolve_dtype(
                config.dtype, self.device, ("float32", "bfloat16", "float16")
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        try:
            self.layout = check_layout(config.layout)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        try:
            self.model_key, self.encoder_id = (
                encoder_identity(config.model, config.revision, config.cache_dir)
                if config.cache
                else (config.model, "")
            )
            self.checkpoint_id = (
                checkpoint_identity(config.model, config.revision) if config.cache else ""
            )
            loaded = load_model(
                config.model, dtype=self.dtype, device=self.device, revision=config.revision
            )
        except CheckpointError as exc:
            raise EngineError(str(exc)) from None
        self.model, self.processor = loaded.model, loaded.processor
        self.model.eval()
        self.sharded = info.world_size > 1
        if self.sharded:
            try:
                self.attn = ShardedAttention(
                    None, info.rank, info.world_size, config.xattn_schedule, config.attention
                )
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            self.model.hooks.text = self.attn.text
            self.model.hooks.visual = self.attn.visual
        self.video: VideoSummary | None = None
        self.subtitle_block = ""  # the subtitle text in the prefilled video prompt ("" = none)
        self.kv_mode: str | None = None
        self.visual = None
        self.features: torch.Tensor | None = None
        self.cache = None
        self.prefixes = PrefixCache(config.cache_dir) if config.cache else None
        try:
            self.visual_opener = VisualKVOpener(
                self.model,
                VisualKVCache(config.cache_dir) if config.cache else None,
                self._all_min,
                config.save_visual_kv,
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self.visual_kv = VisualKVChoice()
        self.diverged = False  # the ranks once decoded different tokens (warned once per session)
        self.last_answer: AnswerStats | None = None
        self.answers: list[dict[str, Any]] = []

    @property
    def subtitle_hash(self) -> str:
        """sha256 of the subtitle block in the prefilled prompt (the saved prompt's key covers it
        through the ids)."""
        return hashlib.sha256(self.subtitle_block.encode()).hexdigest()

    # ---- description and stats
    # ----------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model": self.config.model,
            "generation": cfg.form,
            "world size": self.info.world_size,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout": self.layout,
        }

    def local_stats(self) -> dict[str, Any]:
        row: dict[str, Any] = {"rank": self.info.rank, "device": str(self.device)}
        if self.features is not None:
            row["frames"] = int(self.features.shape[0])
            row["visual E"] = f"{nbytes(self.features) / 2**20:.1f} MiB"
        if self.visual is not None and self.kv_mode == "cache":
            row["visual K/V"] = f"{kv_nbytes(self.visual.kv) / 2**20:.1f} MiB"
        if self.visual_kv.compute_s is not None:
            row["visual K/V compute s"] = round(self.visual_kv.compute_s, 4)
        if self.cache is not None:
            row["text tokens"] = self.cache.length
        if self.video is not None:
            row["video prompt prefill s"] = round(self.prefill_s, 4)
        if self.sharded:
            row["attention bytes sent"] = self.attn.stats.get("fwd_bytes", 0)
        row.update(memory_report(self.device))
        return row

    def summarize_stats(self, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {**self.describe(), "ranks": per_rank}
        if self.video is not None:
            out["video"] = (
                f"{self.video.path}: {self.video.frames} frames, {self.video.visual_tokens:,} "
                "visual tokens"
            )
            out["prompt tokens"] = self.position
            out["kv mode"] = self.kv_mode
            out["visual K/V"] = (
                self.visual_kv.line() if self.kv_mode == "cache" else "recomputed per forward"
            )
        if self.answers:
            last = self.answers[-1]
            out["last answer"] = f"TTFT {last['ttft_s']:.2f} s, {last['tokens_per_s']:.1f} tok/s"
        return out

    # ---- video
    # ----------------------------------------------------------------------------------------------
    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model.encode_images(pixel_values)

    def load_video(
        self,
        path: str,
        fps: float,
        max_frames: int | None,
        subtitles: Sequence[Cue] | None = None,
        progress: ProgressFn | None = None,
    ) -> VideoSummary:
        # long: to be split: it mixes several steps
        """Make the video resident and prefill its prompt: the frames, then the subtitle lines at
        the sampled
        frames (`subtitles`: the cues of the whole video; the feature cache never depends on
        them)."""
        t0 = time.perf_counter()

        def report(p) -> None:
            if progress is not None:
                progress("frames", p.done, p.total)

        try:
            shard = ingest(
                path,
                self._encode,
                fps=fps,
                max_frames=max_frames,
                image_size=self.processor.image_size,
                device=self.device,
                dtype=self.dtype,
                model_id=self.model_key,
                model_revision=self.config.revision or "",
                encoder_id=self.encoder_id,
                cache=self.config.cache,
                cache_dir=self.config.cache_dir,
                decode_workers=self.config.decode_workers,
                decode_timeout_s=self.config.decode_timeout_s,
                progress=report if progress is not None else False,
                layout=self.layout,
            )
        except VideoError as exc:
            raise EngineError(str(exc)) from None
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(self._oom_message("encoding frames")) from exc
        self.features = shard.features  # kept in recompute mode: the one copy K/V are made from
        plan = shard.plan
        n_frames = len(plan)
        block, placed, dropped = self._place_subtitles(subtitles or [], plan.timestamps)
        prompt = self.processor.build_chat_prompt(
            [{"role": "user", "content": _video_text(block)}],
            videos=[n_frames],
            add_generation_prompt=False,
        )
        starts = torch.tensor(prompt.media_starts, dtype=torch.int64)
        self.prefix_len = self._prefix_len(prompt, n_frames, block)
        self.kv_mode = self._kv_mode(n_frames)
        self.visual, self.visual_kv = self.visual_opener.open(
            shard,
            starts,
            self._visual_kv_key(shard, starts),
            resident=self.kv_mode == "cache",
            video=path,
        )
        if self.kv_mode == "cache":
            self.features = (
                None  # the K/V hold everything needed; E stays on disk in the feature cache
            )
        self._reset_text()
        self.subtitle_block = block
        self.prefix_ids = prompt.input_ids[: self.prefix_len]
        t_prefill = time.perf_counter()
        tail_from = int(starts[-1]) + prompt.placeholder_len if n_frames else 0
        restored = self._open_prefix(shard, path, starts, tail_from)
        self.prefill_s = time.perf_counter() - t_prefill
        self.local_prefix_len = self.cache.length
        self.video = VideoSummary(
            path=str(path),
            frames=n_frames,
            fps=float(plan.fps),
            duration_s=float(plan.duration_s),
            visual_tokens=n_frames * self.model.config.vision.num_patches,
            from_cache=shard.from_cache,
            seconds=time.perf_counter() - t0,
            timestamps=[float(t) for t in plan.timestamps],
            subtitle_lines=placed,
            subtitles_dropped=dropped,
            prompt_from_cache=restored,
            visual_kv_from_cache=self.visual_kv.source == "read back",
        )
        return self.video

    # ---- the video prompt: frames, then the subtitle lines
    # ----------------------------------------------------------------------------------------------
    def _place_subtitles(
        self, cues: Sequence[Cue], timestamps: Sequence[float]
    ) -> tuple[str, int, int]:
        """(block, lines placed, lines dropped): the lines at the sampled frames that fit the token
        budget."""
        lines = select_lines(cues, timestamps)
        kept = fit_lines(
            lines, self.config.subtitle_tokens, lambda text: len(self.processor.encode(text))
        )
        dropped = len(lines) - len(kept)
        if dropped and self.info.rank == 0:
            warnings.warn(
                EngineWarning(
                    f"{dropped} of {len(lines)} subtitle lines dropped to fit the "
                    f"{self.config.subtitle_tokens:,}-token "
                    "subtitle budget; the kept lines are spread over the whole video"
                )
            )
        return subtitle_block(kept), len(kept), dropped

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

    # ---- the saved video prompt
    # ----------------------------------------------------------------------------------------------
    def _prefix_key(self, shard: VisualShard) -> PrefixKey | None:
        if self.prefixes is None or shard.cache_key is None or self.config.attention != "lv_xattn":
            # the benchmark baselines keep a sharded text cache: nothing to share with a normal run
            return None
        return PrefixKey.make(
            shard.cache_key,
            checkpoint=self.checkpoint_id,
            prompt_format=PROMPT_FORMAT,
            prompt_ids=self.prefix_ids,
            device=self.device.type,
        )

    def _visual_kv_key(self, shard: VisualShard, starts: torch.Tensor) -> VisualKVKey | None:
        if shard.cache_key is None or not self.config.cache:
            return None
        return VisualKVKey.make(
            shard.cache_key,
            checkpoint=self.checkpoint_id,
            media_starts=starts,
            device=self.device.type,
            dtype=self.dtype,
        )

    def _open_prefix(
        self, shard: VisualShard, path: str, starts: torch.Tensor, tail_from: int
    ) -> bool:
        """Read back the prompt K/V an earlier run saved, when every rank has them and its features
        came from the cache (they were made from those features); else prefill the prompt and save
        it. True when read back."""
        key = self._prefix_key(shard)
        saved = (
            self.prefixes.load(key, self.device, owner=self.info.rank == 0)
            if key is not None
            else None
        )
        if self._all_min(int(saved is not None and shard.from_cache)):
            for i, (k, v) in enumerate(saved.layers):
                self.cache.update(i, k, v)
            if self.sharded:
                self.attn.restore(saved.key_positions)
            self.position = self.prefix_len
            return True
        self._prefill(self.prefix_ids, starts, tail_from=tail_from)
        if (
            key is not None and self.info.rank == 0
        ):  # every rank holds the same whole cache: one file for all
            positions = (
                self.attn.key_positions
                if self.sharded
                else torch.arange(self.cache.length).view(1, -1)
            )
            try:
                self.prefixes.save(
                    key, SavedPrefix(self.cache.layer_kv(), positions), video=Path(path).resolve()
                )
            except OSError as exc:
                warnings.warn(
                    f"could not save the video prompt in {self.prefixes.root} ({exc}); the next "
                    "open will "
                    "prefill it again. Free some space or set LVX_CACHE_DIR.",
                    VideoWarning,
                    stacklevel=2,
                )
        return False

    def _all_min(self, value: int) -> int:
        """The smallest `value` over the ranks (every rank calls this at the same point)."""
        if not self.sharded:
            return value
        box = self._on_wire(torch.tensor([value], dtype=torch.int64))
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        return int(box[0])

    def _on_wire(self, box: torch.Tensor) -> torch.Tensor:
        """`box` where the process group can send it: on this rank's GPU under NCCL, as it is under
        gloo."""
        return box.to(self.device) if dist.get_backend() == "nccl" else box

    def _kv_mode(self, n_frames: int) -> str:
        mode = self.config.kv_mode
        if mode in ("cache", "recompute"):
            return mode
        if mode != "auto":
            raise EngineError(f"unknown kv mode {mode!r}; use cache, recompute or auto")
        if self.device.type != "cuda":
            return "cache"
        cfg = self.model.config
        local = -(-n_frames // self.info.world_size)
        kv_bytes = local * cfg.vision.num_patches * 2 * cfg.num_key_value_heads * cfg.head_dim
        kv_bytes *= len(cfg.hyper_layer_indices) * torch.finfo(self.dtype).bits // 8
        free, _ = torch.cuda.mem_get_info(self.device)
        return "cache" if kv_bytes < 0.5 * free else "recompute"

    def _oom_message(self, stage: str) -> str:
        return (
            f"rank {self.info.rank} ran out of GPU memory while {stage} "
            f"({memory_report(self.device)}); "
            "use more GPUs (--gpus), a lower --fps or --max-frames, or --recompute-kv"
        )

    # ---- text
    # ----------------------------------------------------------------------------------------------
    def _reset_text(self) -> None:
        self.cache = self.model.new_cache()
        self.position = 0  # global number of tokens fed so far
        self.pending: list[int] = []  # tokens to feed before the next user turn
        if self.sharded:
            self.attn.truncate(0)

    def reset(self) -> None:
        """Forget the conversation; keep the video and its prefilled prefix."""
        if self.video is None:
            self._reset_text()
            return
        self.cache.truncate(self.local_prefix_len)
        if self.sharded:
            self.attn.truncate(self.local_prefix_len)
        self.position = self.prefix_len
        self.pending = []

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, *, replicated: bool
    ) -> torch.Tensor:
        if self.sharded:
            self.attn.begin(positions, replicated=replicated)
        with torch.no_grad():
            return self.model(
                ids.view(1, -1).to(self.device),
                positions.view(1, -1).to(self.device),
                cache=self.cache,
                visual=self.visual,
                last_only=True,
            )

    def _share(
        self, n: int, media_starts: torch.Tensor | None, tail_from: int | None
    ) -> tuple[torch.Tensor, int]:
        """(this rank's indices into the n new tokens, sorted; the rank holding the last one).

        The video prompt (`media_starts` given) travels with its frames in the session's layout, and
        its text after the last placeholder (from `tail_from`: it sees every frame) is dealt by the
        same layout; a question is cut into contiguous runs."""
        world, rank = self.info.world_size, self.info.rank
        if media_starts is not None:
            who = token_owners(n, media_starts, world, self.layout, tail_from)
            return torch.nonzero(who == rank).flatten(), int(who[-1]) if n else 0
        start, end = shard_bounds(n, world, rank)
        owner = (
            max(
                r
                for r in range(world)
                if shard_bounds(n, world, r)[1] > shard_bounds(n, world, r)[0]
            )
            if n
            else 0
        )
        return torch.arange(start, end), owner

    def _prefill(
        self,
        ids: torch.Tensor,
        media_starts: torch.Tensor | None = None,
        tail_from: int | None = None,
        *,
        question: bool = False,
    ) -> tuple[torch.Tensor | None, int]:
        """Feed `ids` (global); return (this rank's last logits, rank owning the last token). The
        video prompt and a long question are sharded over the ranks (then the text K/V cache is
        replicated again); a short question is fed whole on every rank (the gather schedule, as
        decoding)."""
        n = int(ids.numel())
        whole = question and self._whole_question(n)
        mine, owner = (torch.arange(n), 0) if whole else self._share(n, media_starts, tail_from)
        cached = self.cache.length
        try:
            logits = self._forward(ids[mine], self.position + mine, replicated=whole)
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(self._oom_message("reading the prompt")) from exc
        if self.sharded and not whole:
            self.attn.replicate(self.cache, cached)
        self.position += n
        return (logits[0, -1] if mine.numel() else None), owner

    def _whole_question(self, n: int) -> bool:
        """Whether a question of `n` tokens is fed whole on every rank (gather schedule), so all
        hold its logits."""
        return self.sharded and self.attn.replicate_queries(n)

    def _turn_ids(self, question: str) -> torch.Tensor:
        if self.video is None:
            raise EngineError("no video is loaded; load one first")
        if not question.strip():
            raise EngineError("the question is empty")
        if self.position == self.prefix_len:  # first turn after load or reset
            full = self.processor.build_chat_prompt(
                [{"role": "user", "content": _video_text(self.subtitle_block, question)}],
                videos=[self.video.frames],
            ).input_ids
            if not torch.equal(full[: self.prefix_len], self.prefix_ids):
                raise RuntimeError(
                    "the prompt prefix changed between load and ask (tokenizer chunking)"
                )
            return full[self.prefix_len :]
        follow = self.processor.build_followup(
            question, offset=self.position + len(self.pending)
        ).input_ids
        return torch.cat([torch.tensor(self.pending, dtype=torch.int64), follow])

    def ask(
        self, question: str, params: GenerationParams, should_stop: Callable[[], bool] = never_stop
    ) -> Iterator[str]:
        """Answer one turn; yields text pieces on rank 0 (other ranks yield nothing)."""
        ids = self._turn_ids(question)
        self._check_length(int(ids.numel()))
        t0 = time.perf_counter()
        stats = AnswerStats(prompt_tokens=self.position + int(ids.numel()))
        stops = set(self.processor.stop_ids)
        decoder = self.processor.stream()
        logits, owner = self._prefill(ids, question=True)
        self.pending = []
        outcome = LoopOutcome()
        # the agreement rides on a hyper layer's visual combine; token ids ride exactly as float32
        # below 2**24
        cfg = self.model.config
        carries = (
            self.sharded
            and self.attn.replicates_cache
            and bool(cfg.hyper_layer_indices)
            and cfg.vocab_size < 2**24
        )
        tokens = token_loop(
            logits,
            self._feed_token,
            params,
            stops,
            outcome,
            agree=self._agree,
            first_src=owner,
            should_stop=should_stop if self.info.rank == 0 else never_stop,
            carried=self._feed_agreeing if carries else None,
            unfeed=self._unfeed,
            carry_first=self._whole_question(int(ids.numel())),
            leader=self.info.rank == 0,
        )
        for token in tokens:
            stats.new_tokens += 1
            piece = decoder.push(token) if token not in stops else ""
            if piece and self.info.rank == 0:
                yield piece
        if outcome.unfed is not None:
            self.pending = [outcome.unfed]
        if outcome.first_token_at is not None:
            stats.ttft_s = outcome.first_token_at - t0
        stats.interrupted, stats.truncated = outcome.interrupted, outcome.truncated
        tail = decoder.flush()
        if tail and self.info.rank == 0:
            yield tail
        self.pending.append(self.processor.stop_ids[0])  # close the assistant turn with <|im_end|>
        stats.total_s = time.perf_counter() - t0
        self.last_answer = stats
        self.answers.append(stats.to_dict())

    def _check_length(self, n: int) -> None:
        """Refuse a question too long to prefill, on every rank alike: the ranks agree on the
        smallest budget first."""
        budget = auto_memory_budget(self.device)
        if self.sharded:
            budget = self._all_min(budget if budget is not None else 2**62)
        shape = PrefillShape(self.info.world_size, self.position, self.dtype.itemsize)
        limit, why = question_limit(self.model.config, shape, budget)
        if n > limit:
            raise QuestionTooLong(too_long(n, limit, why))

    def _feed_token(self, token: int) -> torch.Tensor:
        """One decoding step on every rank: feed the agreed token, return the next logits (V,)."""
        logits = self._forward(
            torch.tensor([token]), torch.tensor([self.position]), replicated=True
        )[0, -1]
        self.position += 1
        return logits

    def _feed_agreeing(self, token: int, stop: bool) -> tuple[torch.Tensor, int, bool]:
        """Feed this rank's own token while the ranks agree on rank 0's token and stop flag in the
        step's first visual combine (no collective of its own). Every rank sees every rank's token,
        so all of them redo a step whose token was not rank 0's, alike."""
        carry = Carry(torch.tensor([token, int(stop)], dtype=torch.float32))
        self.attn.carry = carry
        try:
            logits = self._feed_token(token)
        finally:
            self.attn.carry = None
        # (ranks, 2); every decode step runs the hyper layers
        got = carry.received.cpu().to(torch.int64)
        agreed, agreed_stop = int(got[0, 0]), bool(got[0, 1])
        if not agreed_stop and bool((got[:, 0] != agreed).any()):
            if (
                self.info.rank == 0 and not self.diverged
            ):  # once: a rank whose logits differ may differ every token
                warnings.warn(
                    f"the ranks decoded different tokens ({got[:, 0].tolist()}); rank 0's is used: "
                    "their logits differ, so answers may differ from one process's",
                    EngineWarning,
                )
            self.diverged = True
            self._unfeed()
            logits = self._feed_token(agreed)
        return logits, agreed, agreed_stop

    def _unfeed(self) -> None:
        """Take back the last token fed (every rank holds the whole text cache when decoding)."""
        self.position -= 1
        self.cache.truncate(self.cache.length - 1)
        if self.sharded:
            self.attn.truncate(self.cache.length)

    def _agree(self, token: int | None, stop: bool, src: int) -> tuple[int, bool]:
        """Every rank takes rank `src`'s token and rank 0's stop flag."""
        if not self.sharded:
            return int(token), stop
        box = self._on_wire(
            torch.tensor([token if token is not None else -1, int(stop)], dtype=torch.int64)
        )
        if src == 0:
            dist.broadcast(box, src=0)
            return int(box[0]), bool(box[1])
        tok, flag = box.clone(), box.clone()
        dist.broadcast(tok, src=src)
        dist.broadcast(flag, src=0)
        return int(tok[0]), bool(flag[1])
