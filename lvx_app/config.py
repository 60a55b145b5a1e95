"""The one typed configuration of a run, parsed once and passed whole.

Each command builds a `Config` from its options (the options themselves are made from the fields
below: a field's `flag` and `help` are its command-line option), and hands it to the engine, to the
ranks (as JSON, `Config.to_dict` / `Config.from_dict`), to ingest, eval and finetuning. Every field
is checked once, here, when its section is made: a bad value is one `ConfigError` line that names
the option. Adding an option is one field here plus the code that uses it.

A leaf module: it imports nothing of ours but the defaults, so the CLI can build a config without
importing torch.
"""

from __future__ import annotations

import math
import os
import string
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from lvx_app.defaults import (
    DEFAULT_DECODE_TIMEOUT_S,
    DEFAULT_LAYOUT,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_SPEECH_MODEL,
    DEFAULT_SUBTITLE_TOKENS,
    DEFAULT_TIMEOUT_S,
    LAYOUTS,
)
from lvx_kernels.backend_names import ATTN_BACKENDS

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
KV_MODES = ("auto", "cache", "recompute")
# --media-attention: the frames a text token attends to, as the window of latest frames the kernels
# take (`VisualInputs.window`): every frame placed before it (a question after the video sees all
# of it), or only the latest (OpenFlamingo's published `only_attend_immediate_media`)
MEDIA_ATTENTION: dict[str, int | None] = {"every-frame-before": None, "latest-frame": 1}
SCHEDULES = ("auto", "ring", "gather")
SAVE_VISUAL_KV = ("auto", "always", "never")
TRAIN_MODES = ("hyper", "all", "lora")
SCORING_MODES = ("official", "strict")
EVAL_SUBTITLES = ("none", "official", "speech")  # where a Video-MME run's subtitle lines come from
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # hosts only this machine can reach
KEY_CHARACTERS = frozenset(string.ascii_letters + string.digits + string.punctuation)  # --api-key


FRONTENDS = ("page", "api")  # the frontends that let their users set some video options per video
# A field's metadata beyond its command-line option (never passed to typer):
#   set_by: the frontends whose users may set it for one video (`updated(..., by=...)`); the command
#           line and the Python API set every field
#   key: it changes what a load makes, so a video held with another value is another load
#        (`load_key`); the fields without it say how a video is loaded (decode workers, caches)
#   none_as: what a frontend sends for None (max frames: 0, no cap)
NOT_CLI = ("set_by", "key", "none_as")


class ConfigError(ValueError):
    """A bad option value: one line that names the option and says what to use."""


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    factory: Any = None,
    set_by: tuple[str, ...] = (),
    key: bool = False,
    none_as: Any = None,
    **cli: Any,
) -> Any:
    """A config field that is also a command-line option (`flag`, e.g. "--fps" or
    "--cache/--no-cache"; `cli` holds extra typer settings such as `metavar` or `hidden`).
    `set_by` and `key`: see `NOT_CLI`."""
    meta = {"flag": flag, "help": help, **cli}
    meta.update({"set_by": set_by} if set_by else {})
    meta.update({"key": True} if key else {})
    meta.update({"none_as": none_as} if none_as is not None else {})
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(value: str, choices: tuple[str, ...], flag: str) -> None:
    _require(value in choices, f"unknown {flag} {value!r}; use one of {', '.join(choices)}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    """A number, and not true/false (JSON's `true` would pass as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_speech_language(value: str | None) -> None:
    """A language code Whisper knows (checked here, before any rank or model starts: faster-whisper
    itself refuses a name such as english only after the model has loaded)."""
    if value is None:
        return
    codes = speech_language_codes()
    _require(
        isinstance(value, str) and (value in codes if codes else value.isalpha()),
        f"--speech-language takes a Whisper language code (got {value!r}): "
        + (", ".join(codes) if codes else "en, fr, de, ..."),
    )


def speech_language_codes() -> tuple[str, ...]:
    """The language codes of faster-whisper's tokenizer; () without the [speech] extra."""
    try:
        from faster_whisper.tokenizer import _LANGUAGE_CODES
    except ImportError:
        return ()
    return tuple(_LANGUAGE_CODES)


def _positive(value: float, flag: str, what: str = "a number above 0") -> None:
    _require(
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0,
        f"{flag} must be {what} (got {value!r})",
    )


@dataclass
class ModelConfig:
    """Which checkpoint, and in which dtype."""

    path: str = option(
        DEFAULT_MODEL,
        "--model",
        "Local checkpoint directory or Hugging Face hub id, of any family `lvx info` lists: its "
        "config.json, or the files its family is known by, says which.",
        metavar="DIR|HUB_ID",
    )
    revision: str | None = option(
        None, "--revision", "Hub revision (branch, tag or commit).", metavar="REV"
    )
    dtype: str = option(
        "auto",
        "--dtype",
        "auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16, float16.",
        metavar="auto|float32|bfloat16|float16",
    )
    cuda_graphs: bool = option(
        False,
        "--cuda-graphs/--no-cuda-graphs",
        "Replay each decoded token's step as one CUDA graph, captured once per session (GPUs; "
        "on several, NCCL; greedy answers).",
    )
    compile_decode: bool = option(
        False,
        "--compile-decode/--no-compile-decode",
        "Run each decoded token's step through torch.compile (one GPU, greedy answers).",
    )
    attn_backend: str = option(
        "auto",
        "--attn-backend",
        "Attention kernel: auto (the best for each call), or one to prefer wherever it can run "
        "the call: " + ", ".join(ATTN_BACKENDS[1:]) + ".",
        envvar="LVX_ATTN_BACKEND",
        metavar="auto|NAME",
    )

    def __post_init__(self) -> None:
        _require(bool(str(self.path).strip()), "--model must name a checkpoint folder or hub id")
        _choice(self.dtype, DTYPES, "--dtype")
        _choice(self.attn_backend, ATTN_BACKENDS, "--attn-backend")


@dataclass(frozen=True)
class VideoConfig:
    """How a video becomes visual tokens: sampling, decoding, subtitles, caches, K/V memory. One
    load's options travel in a `lvx_app.engine.records.VideoRequest`."""

    fps: float = option(
        1.0,
        "--fps",
        "Frames sampled per second of video.",
        set_by=FRONTENDS,
        key=True,
        metavar="FPS",
    )
    max_frames: int | None = option(
        None,
        "--max-frames",
        "Most frames to use; a longer plan is thinned uniformly. Default: all.",
        set_by=FRONTENDS,
        key=True,
        none_as=0,
    )
    num_frames: int | None = option(
        None,
        "--num-frames",
        "Sample exactly N frames spread evenly over the whole video, its first and last frames "
        "included, as vLLM's num_frames does (every frame when it has fewer); --fps is then "
        "unused. Default: sample at --fps.",
        set_by=("api",),
        key=True,
        none_as=0,
        metavar="N",
    )
    subtitles: str = option(
        "auto",
        "--subtitles",
        "auto: a subtitle file next to the video with its name (movie.en.srt too), else a text "
        "subtitle stream inside it, else its speech transcribed (with the [speech] extra); "
        "speech: always transcribe; none; or a subtitle FILE. Only the lines at the sampled "
        "frames are used.",
        set_by=FRONTENDS,
        key=True,
        metavar="auto|speech|none|FILE",
    )
    subtitle_lang: str | None = option(
        None,
        "--subtitle-lang",
        "Language of the subtitles --subtitles auto picks (en, fr, ...).",
        key=True,
        metavar="LANG",
    )
    subtitle_encoding: str | None = option(
        None,
        "--subtitle-encoding",
        "Text encoding of the subtitle file. Default: UTF-8, else detected.",
        key=True,
        metavar="ENCODING",
    )
    speech_model: str = option(
        DEFAULT_SPEECH_MODEL,
        "--speech-model",
        "Whisper checkpoint that transcribes speech (a faster-whisper name such as small or "
        "large-v3-turbo, a hub id, or a local folder); auto: large-v3-turbo on GPUs, base on a "
        "CPU.",
        key=True,
        metavar="NAME|DIR",
    )
    speech_language: str | None = option(
        None,
        "--speech-language",
        "Language spoken in the video (en, fr, ...). Default: detected.",
        key=True,
        metavar="LANG",
    )
    subtitle_tokens: int = option(
        DEFAULT_SUBTITLE_TOKENS,
        "--subtitle-tokens",
        "Most tokens the subtitle lines may take; beyond it lines are dropped evenly over the "
        "video.",
        key=True,
    )
    kv_mode: str = option(
        "auto",
        "--kv-mode",
        "cache: keep each hyper layer's visual K/V resident; recompute: keep one copy of the "
        "features and recompute K/V per turn (less memory); auto: cache when it fits.",
        key=True,
        metavar="auto|cache|recompute",
    )
    media_attention: str = option(
        "every-frame-before",
        "--media-attention",
        "The frames a text token attends to: every-frame-before (every frame placed before it, so "
        "a question after the video sees all of it) or latest-frame (only the latest frame before "
        "it, OpenFlamingo's published masking: a question then sees the last frame alone).",
        key=True,
        metavar="every-frame-before|latest-frame",
    )
    cache: bool = option(
        True, "--cache/--no-cache", "Read and write the cache of frame features and saved prompts."
    )
    cache_dir: str | None = option(
        None,
        "--cache-dir",
        "Cache folder. Default: $LVX_CACHE_DIR, else ~/.cache/lvx.",
        metavar="DIR",
    )
    cache_limit_gb: float | None = option(
        None,
        "--cache-limit-gb",
        "Largest size of the cache folder, in GB: past it, after a load, the entries used least"
        " recently are removed. Default: no limit.",
        metavar="GB",
    )
    decode_timeout_s: float = option(
        DEFAULT_DECODE_TIMEOUT_S,
        "--decode-timeout",
        "Seconds one chunk of frames may take to decode before it is retried frame by frame.",
        metavar="SECONDS",
    )
    decode_workers: int | None = None  # decode processes per rank (None: by the cores)
    save_visual_kv: str = "auto"  # auto (when reading back beats computing) | always | never

    def __post_init__(self) -> None:
        _positive(self.fps, "--fps", "above 0, e.g. --fps 1, or --fps 0.2 for a frame every 5 s")
        _require(
            self.max_frames is None or (_whole(self.max_frames) and self.max_frames >= 1),
            f"--max-frames must be 1 or more (got {self.max_frames!r})",
        )
        _require(
            self.num_frames is None or (_whole(self.num_frames) and self.num_frames >= 1),
            f"--num-frames must be 1 or more (got {self.num_frames!r})",
        )
        _require(
            isinstance(self.subtitles, str) and bool(self.subtitles.strip()),
            f"--subtitles takes auto, speech, none or a subtitle FILE (got {self.subtitles!r})",
        )
        for name, value in (("lang", self.subtitle_lang), ("encoding", self.subtitle_encoding)):
            _require(value is None or isinstance(value, str), f"--subtitle-{name} takes a name")
        _require(
            isinstance(self.speech_model, str) and bool(self.speech_model.strip()),
            "--speech-model takes a Whisper checkpoint's name or folder, or auto",
        )
        _check_speech_language(self.speech_language)
        _require(
            _whole(self.subtitle_tokens) and self.subtitle_tokens >= 0,
            f"--subtitle-tokens must be 0 (no subtitles) or more (got {self.subtitle_tokens!r})",
        )
        _choice(self.kv_mode, KV_MODES, "--kv-mode")
        _choice(self.media_attention, tuple(MEDIA_ATTENTION), "--media-attention")
        _require(isinstance(self.cache, bool), "--cache is true or false")
        _require(
            self.cache_dir is None or isinstance(self.cache_dir, (str, os.PathLike)),
            "--cache-dir is a folder's path",
        )
        _positive(self.decode_timeout_s, "--decode-timeout", "a number of seconds above 0")
        if self.cache_limit_gb is not None:
            _positive(self.cache_limit_gb, "--cache-limit-gb")
        _require(
            self.decode_workers is None
            or (_whole(self.decode_workers) and self.decode_workers >= 1),
            "decode_workers must be 1 or more",
        )
        _choice(self.save_visual_kv, SAVE_VISUAL_KV, "save_visual_kv")


@dataclass
class ParallelConfig:
    """Where the ranks run and how the video and queries are dealt over them."""

    gpus: int | None = option(
        None, "--gpus", "GPUs to use, one rank each. Default: 1 if a GPU is visible, else 0 (CPU)."
    )
    ranks: int | None = option(
        None, "--ranks", "CPU ranks (gloo) when there is no GPU or with --gpus 0. Default: 1."
    )
    layout: str = option(
        DEFAULT_LAYOUT,
        "--layout",
        "How frames and their prompt tokens are dealt over the ranks: zigzag (balanced), striped "
        "or contiguous. The answers are the same on every layout.",
        metavar="zigzag|striped|contiguous",
    )
    xattn_schedule: str = option(
        "auto",
        "--xattn-schedule",
        "A question's cross-attention over the ranks: gather (short questions), ring (long ones) "
        "or auto (by the measured crossover). The video prompt always takes the ring.",
        metavar="auto|ring|gather",
    )
    timeout_s: float = option(
        DEFAULT_TIMEOUT_S,
        "--timeout",
        "Seconds a rank waits for a dead or hung peer during work before the group stops.",
        metavar="SECONDS",
    )
    rank_memory_gib: float | None = option(
        None,
        "--rank-memory-gib",
        "Memory one rank may use for a video's features and a question's prefill, in GiB. "
        "Default: what is free when it is needed (80 % of the available RAM; a GPU's free memory "
        "less 2 GiB).",
        envvar="LVX_RANK_MEMORY_GIB",
        metavar="GIB",
    )

    def __post_init__(self) -> None:
        _require(
            self.gpus is None or (_whole(self.gpus) and self.gpus >= 0),
            f"--gpus must be 0 (CPU) or a positive number of GPUs (got {self.gpus!r})",
        )
        _require(
            self.ranks is None or (_whole(self.ranks) and self.ranks >= 1),
            f"--ranks must be a whole number, at least 1 (got {self.ranks!r})",
        )
        _choice(self.layout, LAYOUTS, "--layout")
        _choice(self.xattn_schedule, SCHEDULES, "--xattn-schedule")
        _positive(self.timeout_s, "--timeout", "a number of seconds above 0")
        if self.rank_memory_gib is not None:
            _positive(self.rank_memory_gib, "--rank-memory-gib", "a number of GiB above 0")


@dataclass(frozen=True)
class GenerationConfig:
    """How an answer is generated; greedy by default, so answers are reproducible."""

    max_new_tokens: int | None = option(
        None,
        "--max-new-tokens",
        "Longest answer, in tokens. Default: the checkpoint's own (max_new_tokens in its "
        f"generation_config.json), else {DEFAULT_MAX_NEW_TOKENS}.",
    )
    temperature: float = option(
        0.0,
        "--temperature",
        "0 = greedy (reproducible); above 0 samples.",
        metavar="T",
        set_by=("api",),
    )
    top_p: float = option(
        1.0,
        "--top-p",
        "Nucleus sampling mass (0 < p <= 1) when sampling.",
        metavar="P",
        set_by=("api",),
    )
    seed: int = option(
        0, "--seed", "Seed of sampling (answers repeat for the same seed).", set_by=("api",)
    )
    evidence: bool = option(
        True,
        "--evidence/--no-evidence",
        "Show where in the video each answer looked (moments with their share of its attention).",
    )

    def __post_init__(self) -> None:
        _require(
            self.max_new_tokens is None
            or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
            f"--max-new-tokens must be 1 or more (got {self.max_new_tokens!r})",
        )
        _require(
            _real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
            "--temperature must be 0 (greedy) or a finite number above 0 (got "
            f"{self.temperature!r})",
        )
        _require(
            _real(self.top_p) and 0 < self.top_p <= 1,
            f"--top-p must be above 0 and at most 1 (got {self.top_p!r})",
        )
        _require(_whole(self.seed), f"--seed must be a whole number (got {self.seed!r})")


@dataclass
class ServeConfig:
    """The browser page and the OpenAI-compatible API: where they listen and what they accept."""

    host: str = option(
        "127.0.0.1",
        "--host",
        "Address to bind; other machines can connect only if you change it.",
        metavar="ADDRESS",
    )
    port: int = option(7860, "--port", "Port to serve on.", metavar="PORT")
    allow_paths: list[str] = option(
        None,
        "--allow-paths",
        "Folder whose videos may be opened by path instead of uploaded (repeatable).",
        factory=list,
        metavar="DIR",
    )
    max_upload_mb: float | None = option(
        None,
        "--max-upload-mb",
        "Largest upload accepted, in MB. Default: a quarter of --request-memory-mb (a video sent"
        " in a request's body, as base64, takes four times its size while it is read).",
        metavar="MB",
    )
    request_memory_mb: float | None = option(
        None,
        "--request-memory-mb",
        "Memory one API request may take while it is read (its body, its frames decoded), in MB;"
        " more is refused. Default: 1/16 of the machine's memory, at most 4096.",
        metavar="MB",
    )
    requests_memory_mb: float | None = option(
        None,
        "--requests-memory-mb",
        "Memory all API requests in flight may take together, in MB; a request past it is turned"
        " away (429). Default: 1/4 of the machine's memory.",
        metavar="MB",
    )
    auth: str | None = option(
        None, "--auth", "Require a login, given as user:password.", metavar="USER:PASSWORD"
    )
    share: bool = option(False, "--share/--no-share", "Also open a public Gradio share link.")
    queue_size: int = option(
        64,
        "--queue-size",
        "Requests that may wait for the engine; more are turned away (429).",
        metavar="N",
    )
    queue_timeout: float = option(
        1800.0,
        "--queue-timeout",
        "Longest an API request waits for the engine before it is turned away (429), in seconds.",
        metavar="SECONDS",
    )
    send_timeout: float = option(
        60.0,
        "--send-timeout",
        "Longest a streamed answer waits for its client to take the next piece, in seconds; past"
        " it the answer is stopped and the engine freed.",
        metavar="SECONDS",
    )
    api_key: str | None = option(
        None,
        "--api-key",
        "Key the OpenAI-compatible API (/v1) requires as a Bearer token.",
        envvar="LVX_API_KEY",
        show_default=False,
        metavar="KEY",
    )
    no_ui: bool = option(False, "--no-ui", "Serve the OpenAI-compatible API alone, no page.")
    insecure: bool = option(
        False, "--insecure", "Allow a --host other machines can reach without --api-key."
    )

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, f"--port must be 1..65535 (got {self.port})")
        where = "--share" if self.share else f"--host {self.host}"
        _require(
            (self.host in LOOPBACK and not self.share) or bool(self.api_key) or self.insecure,
            f"{where} lets other machines use the API: give --api-key KEY (or set LVX_API_KEY), "
            "or --insecure to serve it without a key",
        )
        for value, flag in (
            (self.max_upload_mb, "--max-upload-mb"),
            (self.request_memory_mb, "--request-memory-mb"),
            (self.requests_memory_mb, "--requests-memory-mb"),
        ):
            if value is not None:
                _positive(value, flag)
        _require(self.queue_size >= 1, "--queue-size must be at least 1")
        _positive(self.queue_timeout, "--queue-timeout")
        _positive(self.send_timeout, "--send-timeout")
        _require(
            self.api_key != "",
            "--api-key is empty (an unset variable?): give the key, or leave --api-key out to "
            "serve without one",
        )
        _require(
            not self.api_key or set(self.api_key) <= KEY_CHARACTERS,
            "--api-key must be ASCII letters, digits and punctuation: an HTTP header carries no "
            "other characters",
        )
        if self.auth is not None:
            user, sep, password = self.auth.partition(":")
            _require(
                bool(sep and user and password),
                "--auth takes user:password, for example --auth alice:s3cret",
            )


@dataclass
class TrainConfig:
    """Finetuning: data, what is trained, the schedule and checkpoints."""

    data: str = option(
        "",
        "--data",
        "JSONL file: one {video, question, answer} sample per line.",
        required=True,
        metavar="FILE",
    )
    out: str = option(
        "",
        "--out",
        "Output checkpoint folder (loadable with lvx chat --model OUT).",
        required=True,
        metavar="DIR",
    )
    video_dir: str | None = option(
        None,
        "--video-dir",
        "Folder the samples' video names are relative to. Default: the data's.",
        metavar="DIR",
    )
    mode: str | None = option(
        None,
        "--train",
        "What to train: hyper (the cross layers' visual K/V projections and gates, the default) or "
        "all (language model and projector; the vision tower stays frozen). Or use --lora R.",
        metavar="hyper|all",
    )
    lora_rank: int | None = option(
        None,
        "--lora",
        "Train LoRA adapters of rank R on the attention projections instead.",
        metavar="R",
    )
    lora_alpha: float | None = None  # default 2 * rank
    recompute: bool = option(
        True,
        "--recompute/--no-recompute",
        "Recompute each hyper layer's visual K/V in backward from one copy of the features.",
    )
    checkpoint_lm: bool = option(
        False, "--checkpoint-lm", "Checkpoint the decoder layers (less activation memory)."
    )
    lr: float = option(
        1e-4, "--lr", "Peak learning rate (AdamW, warm-up then cosine).", metavar="RATE"
    )
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # default 5 % of steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    steps: int = option(100, "--steps", "Optimizer steps (one sample each).")
    save_every: int = option(
        50, "--save-every", "Also save every N steps, so a crash loses little (0: only at the end)."
    )
    resume: bool = option(False, "--resume", "Continue the run saved in --out.")
    seed: int = option(0, "--seed", "Seed of the LoRA initialisation and the sample order.")
    progress: bool | None = None  # None: a live bar on a terminal, else a line per step
    plot: bool = True

    def __post_init__(self) -> None:
        _require(
            self.mode is None or self.lora_rank is None,
            "use either --lora R or --train hyper|all, not both",
        )
        if self.mode is not None:
            _choice(self.mode, TRAIN_MODES[:2], "--train")
        _require(self.lora_rank is None or self.lora_rank >= 1, "--lora must be at least 1")
        _require(self.steps >= 1, "--steps must be at least 1")
        _require(self.save_every >= 0, "--save-every must be 0 (only at the end) or more")
        _positive(self.lr, "--lr")

    @property
    def trains(self) -> str:
        """What is trained: "lora", "hyper" or "all"."""
        return "lora" if self.lora_rank is not None else (self.mode or "hyper")


@dataclass
class EvalConfig:
    """A Video-MME run: the data, which questions, how answers are scored."""

    data: str = option(
        "",
        "--data",
        "Folder with videomme/test-*.parquet, data/, subtitle/.",
        required=True,
        metavar="DIR",
    )
    out: str | None = option(
        None, "--out", "Results JSONL (resumed if it exists). Default: under runs/.", metavar="FILE"
    )
    questions: str | None = option(
        None, "--questions", "Question file, if not under --data/videomme/.", metavar="FILE"
    )
    subtitles: str = option(
        "none",
        "--subtitles",
        "official: the with-subtitles setting (Video-MME's subtitle files); speech: the same with "
        "each video's speech transcribed instead (the [speech] extra); none.",
        metavar="none|official|speech",
    )
    limit: int | None = option(None, "--limit", "Only the first N selected questions.")
    durations: str | None = option(
        None, "--durations", "Comma list of short,medium,long.", metavar="LIST"
    )
    shard: str | None = option(
        None, "--shard", "i/k: this machine's share (0-based), split by video.", metavar="I/K"
    )
    scoring: str = option(
        "official",
        "--scoring",
        "official (unparsed replies dropped) or strict (unparsed = wrong).",
        metavar="official|strict",
    )

    def __post_init__(self) -> None:
        if isinstance(self.subtitles, bool):  # a results header or a caller of before: on / off
            self.subtitles = "official" if self.subtitles else "none"
        _choice(self.subtitles, EVAL_SUBTITLES, "--subtitles")
        _choice(self.scoring, SCORING_MODES, "--scoring")
        _require(self.limit is None or self.limit >= 1, "--limit must be 1 or more")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "video": VideoConfig,
    "parallel": ParallelConfig,
    "generation": GenerationConfig,
    "serve": ServeConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}
ENGINE_SECTIONS = ("model", "video", "parallel", "generation")  # what `lvx_app.open` takes


@dataclass
class Config:
    """Every option of a run, by section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data (JSON-ready), as `from_dict` reads it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """The config a `to_dict` (or a hand-written JSON) describes; a missing key keeps its
        default,
        an unknown one is a ConfigError that lists the valid keys."""
        if not isinstance(data, dict):
            raise ConfigError("a config is a JSON object with the sections " + ", ".join(SECTIONS))
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise ConfigError(
                f"unknown config section {unknown[0]!r}; valid: {', '.join(SECTIONS)}"
            )
        return cls(**{name: section(SECTIONS[name], data.get(name, {})) for name in SECTIONS})

    @classmethod
    def from_options(cls, **options: Any) -> Config:
        """A config from flat option names of the engine's sections (`lvx_app.open(model, fps=1,
        ranks=2)`): each name is the field of the one section that has it (`model` is the
        checkpoint)."""
        by_section: dict[str, dict[str, Any]] = {name: {} for name in ENGINE_SECTIONS}
        owners = {f.name: name for name in ENGINE_SECTIONS for f in fields(SECTIONS[name])}
        owners["model"] = "model"
        for key, value in options.items():
            _require(key in owners, f"unknown option {key!r}; valid: {', '.join(sorted(owners))}")
            by_section[owners[key]]["path" if key == "model" else key] = value
        return cls.from_dict(by_section)


def section(cls: type, values: dict[str, Any]) -> Any:
    """One section from a dict: an unknown key is a ConfigError listing the valid ones."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {cls.__name__} must be an object, not {values!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; valid: {', '.join(names)}")
    return cls(**typed(cls, values))


def updated(config: Any, *, by: str | None = None, **changes: Any) -> Any:
    """A copy of one section with some fields changed (checked like any new section); an unknown
    name is a ConfigError listing the valid ones. `by`: the frontend ("page", "api") whose user
    asked: only the fields it may set (`settable`)."""
    names = [f.name for f in fields(config)] if by is None else list(settable(type(config), by))
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; valid: {', '.join(names)}")
    if by is not None:  # a frontend's stand-in for None (0 max frames: no cap)
        for f in fields(config):
            none_as = f.metadata.get("none_as")
            value = changes.get(f.name)
            if none_as is not None and type(value) is type(none_as) and value == none_as:
                changes[f.name] = None
    return replace(config, **typed(type(config), changes))


KINDS = {
    "str": ((str,), "text"),
    "int": ((int,), "a whole number"),
    "bool": ((bool,), "True or False"),
}
KINDS["float"] = ((int, float), "a number")


def typed(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` for fields of `cls`, each of the kind its field declares (a path object given for
    text made text): a value of another kind (None for the model, text for a count, a number for
    a name) is one ConfigError line naming the option, before the section's own checks read it."""
    out = dict(values)
    for f in fields(cls):
        if f.name not in out or not isinstance(f.type, str):
            continue
        parts = [part.strip() for part in f.type.split("|")]
        optional = "None" in parts
        simple = [KINDS.get(part) for part in parts if part != "None"]
        if len(simple) != 1 or simple[0] is None:
            continue  # a tuple, a choice of kinds: the section checks it
        (kinds, word), value = simple[0], out[f.name]
        if isinstance(value, os.PathLike) and str in kinds:
            value = out[f.name] = os.fspath(value)
        if value is None and optional:
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            name = f.metadata.get("flag", f.name).split("/")[0]
            choices = f.metadata.get("metavar", "").split("|")
            if str in kinds and len(choices) > 1:  # its metavar says what the text may be
                word = ", ".join(choices[:-1]) + " or " + choices[-1]
            raise ConfigError(f"{name} takes {word}, not {value!r:.40}")
    return out


def settable(cls: type, frontend: str) -> tuple[str, ...]:
    """The fields of a section that `frontend`'s users may set for one video (their `set_by`)."""
    return tuple(f.name for f in fields(cls) if frontend in f.metadata.get("set_by", ()))


def load_key(config: Any) -> tuple[tuple[str, Any], ...]:
    """(name, value) of the fields of a section that change what a load makes (their `key`)."""
    return tuple((f.name, getattr(config, f.name)) for f in fields(config) if f.metadata.get("key"))


def frontend_words(message: str, cls: type, frontend: str) -> tuple[str, str | None]:
    """(a ConfigError's line with the flags of the fields `frontend` sets put as it names them (the
    API by the field, max_frames; the page in words, max frames), the first such field named)."""
    named = None
    for f in fields(cls):
        flag = f.metadata.get("flag", "")
        if frontend in f.metadata.get("set_by", ()) and flag in message:
            word = f.name if frontend == "api" else f.name.replace("_", " ")
            message, named = message.replace(flag, word), named or f.name
    return message, named


def cli_fields(cls: type) -> list[Any]:
    """The fields of a section that are command-line options, in declaration order."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def field_default(f: Any) -> Any:
    """A field's default value (its factory's value for lists)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory()
