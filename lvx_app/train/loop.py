"""The distributed finetuning step and loop (each rank runs it through `lvx_app.train.train_rank`).

Every rank works on the same sample (sequence parallelism, not data parallelism):
- frames: each rank ingests the frames `--layout` deals it (`lvx_app.parallel.layout`: zigzag by
  default; cached features, since the vision tower stays frozen) and keeps ONE copy E_local that
  every hyper layer reads;
- text: each frame's placeholder tokens go with the frame, and the text after the last placeholder
  (it sees every frame) is dealt by the same layout, so the media-masked and causal work are both
  balanced; each rank runs the language model on its tokens at their true positions;
- attention: `recompute.TrainAttention` (LV-XAttn rings for text and visual attention, K/V
  recomputed in backward);
- loss: cross-entropy summed over the rank's assistant tokens, divided by the GLOBAL number of
  assistant tokens; each rank's backward then yields its share of every replicated weight's
  gradient, and torch DDP all-reduces them (its mean is undone by scaling the local loss by the
  world size).
Optimiser AdamW, linear warm-up then cosine decay to 10 %, gradient clipping, bf16 autocast on GPU
with float32 master copies of the trainable weights.

Trainable sets, each named by the model (`trainable_parameters`): `lora` (LoRA adapters of rank R
on every Linear the model names as a target: its attention projections, the visual K/V projection
and a gate's Linear included; peft is not a dependency: `lora.LoRALinear` is the whole adapter),
`hyper` (what makes the visual K/V of every cross-attention layer, and the gate mixing it in), `all`
(language model + projector; the vision tower stays frozen so its features can be cached).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lvx_app.cache.fingerprints import fingerprint_memo
from lvx_app.config import MEDIA_ATTENTION, Config, TrainConfig
from lvx_app.devices import peak_memory_bytes, resolve_dtype
from lvx_app.parallel import get_rank, get_world_size
from lvx_app.parallel.layout import rank_tokens
from lvx_app.train.data import IGNORE, Sample, Tokenized, load_jsonl, tokenize
from lvx_app.train.lora import add_lora
from lvx_app.train.out_folder import (
    family_to_finetune,
    load_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from lvx_app.train.recompute import TrainAttention, checkpoint_lm_blocks
from lvx_app.video.ingest import Encoder, IngestTuning, ingest, rank_memory_budget

WEIGHT_DTYPES = ("float32", "bfloat16", "float64")  # what --dtype may name besides auto


# --------------------------------------------------------------------------------------------------
# trainable sets
# --------------------------------------------------------------------------------------------------


def configure_trainable(model: Any, train: TrainConfig) -> list[tuple[str, nn.Parameter]]:
    """Freeze everything, then enable (and create, for LoRA) the chosen set; returns the trainable
    parameters (the model names them: `trainable_parameters`)."""
    model.requires_grad_(False)
    if train.trains == "lora":
        add_lora(model, train.lora_rank, train.lora_alpha)
        which = "adapters"
    elif train.trains in ("hyper", "all"):
        which = train.trains
    else:
        raise ValueError(f"--train must be hyper or all (or use --lora R), not {train.trains!r}")
    params = model.trainable_parameters(which)
    if not params:
        raise ValueError(f"the {train.trains} set selects no parameter in this model")
    for _, p in params:
        p.requires_grad_(True)
    return params


# --------------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------------


def lr_lambda(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 down to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def planned_steps(state: dict[str, Any]) -> int | None:
    """The --steps a saved run's schedule was made for (older states keep it in their config)."""
    if "planned_steps" in state:
        return int(state["planned_steps"])
    config = state.get("config") or {}
    steps = (config.get("train") or {}).get("steps", config.get("steps"))
    return None if steps is None else int(steps)


def lr_schedule(
    cfg: TrainConfig, planned: int | None = None, resumed_at: int = 0
) -> Callable[[int], float]:
    """The learning-rate factor of each step: warm-up, then cosine down to `min_lr_ratio` at
    `cfg.steps`. A run resumed after its warm-up with other --steps than it was `planned` for goes
    on down from the rate it reached to `min_lr_ratio` over the steps left: never back up."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
    if planned is None or planned == cfg.steps or resumed_at < warmup or resumed_at >= cfg.steps:
        return lambda s: lr_lambda(s, cfg.steps, warmup, cfg.min_lr_ratio)
    old_warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, planned // 20)
    reached = lr_lambda(resumed_at, planned, old_warmup, cfg.min_lr_ratio)
    low, left = cfg.min_lr_ratio, cfg.steps - resumed_at

    def resumed(s: int) -> float:
        if s < resumed_at:
            return lr_lambda(s, planned, old_warmup, low)
        t = min(1.0, (s - resumed_at) / left)
        return low + (reached - low) * 0.5 * (1 + math.cos(math.pi * t))

    return resumed


@dataclass
class StepStats:
    step: int
    loss: float  # mean cross-entropy over the sample's assistant tokens (all ranks)
    tokens: int  # text tokens of the sample
    frames: int
    seconds: float
    grad_norm: float
    lr: float
    peak_mem: list[int] = field(default_factory=list)  # bytes, per rank

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Trainer:
    """Model, hooks, DDP wrapper, optimiser and schedule of one rank. Works in a single process
    (world of one) and under torch.distributed (every rank builds one with the same config)."""

    def __init__(
        self,
        run: Config,
        device: Optional[torch.device] = None,
        state: Optional[dict[str, Any]] = None,
    ):
        self.run, cfg = run, run.train
        self.rank, self.world = get_rank(), get_world_size()
        self.device = device or torch.device("cpu")
        dtype = resolve_dtype(run.model.dtype, self.device, WEIGHT_DTYPES)
        torch.manual_seed(cfg.seed)
        family = family_to_finetune(run.model.path, run.model.revision)
        with fingerprint_memo(run.video.cache_dir) as memo:  # the feature cache's key
            self.model_key, self.encoder_id = family.encoder_identity(
                run.model.path, run.model.revision, memo
            )
        model, self.model_config, self.processor = family.load(
            run.model.path, dtype=dtype, device=self.device, revision=run.model.revision, fuse=False
        )
        self.model = model
        self.params = configure_trainable(model, cfg)
        for _, p in self.params:  # float32 master weights under bf16 autocast
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()
        if state is not None:
            self._load_trainable(state["trainable"])
        # attention rings get their own group so they never interleave with DDP's gradient
        # all-reduces
        self.group = dist.new_group(list(range(self.world))) if self.world > 1 else None
        self.hooks = TrainAttention(model, group=self.group, recompute=cfg.recompute)
        if cfg.checkpoint_lm:
            checkpoint_lm_blocks(model, self.hooks)
        self.ddp: nn.Module = model
        if self.world > 1:
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
            DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
            self.ddp = DDP(model)
        trainable = [p for _, p in self.params]
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay,
            foreach=False if dtype == torch.float64 else None,
        )
        resumed_at, planned = (int(state["step"]), planned_steps(state)) if state else (0, None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule(cfg, planned, resumed_at)
        )
        self.step = 0
        self.history: list[dict[str, Any]] = []
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.history = list(state.get("history", []))
        self.autocast = self.device.type == "cuda" and dtype != torch.float64
        self.projector_trains = model.projector_trains()
        self._videos: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    # ---- state
    # ----------------------------------------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.params}

    def _load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        have = dict(self.params)
        if set(tensors) != set(have):
            raise ValueError(
                "the resume state was saved with a different trainable set (--lora/--train); "
                "resume with the same options"
            )
        with torch.no_grad():
            for n, t in tensors.items():
                have[n].copy_(t)

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "trainable": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "history": self.history,
            "base_model": self.run.model.path,
            "config": self.run.to_dict(),
            "planned_steps": self.run.train.steps,  # what the learning-rate schedule was made for
        }

    # ---- data
    # ----------------------------------------------------------------------------------------------
    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.projector_trains:  # tower features only; the projector runs in the step, with grad
            return self.model.vision_features(pixel_values)
        return self.model.encode_images(pixel_values)

    def video_features(self, path: str | Path) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(this rank's features, their global frame ids, total frames), through ingest and its disk
        cache."""
        key = str(path)
        if key not in self._videos:
            encoder = Encoder(
                self._encode,
                image_size=self.processor.image_size,
                model_id=f"{self.model_key}#{'siglip' if self.projector_trains else 'projector'}",
                revision=self.run.model.revision or "",
                fingerprint=self.encoder_id,
                prep=self.processor.frame_prep,
            )
            video = replace(self.run.video, cache=True)
            layout = self.run.parallel.layout
            budget = rank_memory_budget(self.device, self.run.parallel.rank_memory_gib)
            shard = ingest(
                path,
                encoder,
                video,
                device=self.device,
                dtype=self.model.vision_dtype,
                layout=layout,
                progress=False,
                tuning=IngestTuning(memory_budget_bytes=budget),
            )
            if len(self._videos) >= 4:
                self._videos.pop(next(iter(self._videos)))
            self._videos[key] = (shard.features, shard.positions.to(self.device), len(shard.plan))
        return self._videos[key]

    # ---- one step
    # ----------------------------------------------------------------------------------------------
    def forward(
        self, tok: Tokenized, features: torch.Tensor, frame_ids: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Forward of one sample on this rank: (this rank's summed CE over its assistant tokens,
        global targets).

        tok: the whole sample (every rank has it); features: this rank's frames (N_local, 729, H)
        (SigLIP features when the projector trains); frame_ids: their global indices."""
        n_targets = tok.num_targets
        if n_targets == 0:
            raise ValueError(
                "a sample without assistant tokens (after truncation) has nothing to learn"
            )
        starts = tok.media_starts
        # from here on every token sees every frame
        tail = int(starts[-1]) + 1 if starts.numel() else 0
        positions = rank_tokens(
            tok.input_ids.numel(),
            starts,
            self.world,
            self.rank,
            self.run.parallel.layout,
            tail_from=tail,
        )
        ids = tok.input_ids[positions].to(self.device).view(1, -1)
        labels = tok.labels[positions].to(self.device)
        pos = positions.to(self.device).view(1, -1)
        feed = self.hooks.feed(positions.view(1, -1), self.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            e = self.model.project(features) if self.projector_trains else features
            # one copy of E; the hooks make each layer's K/V from it (and again in backward)
            visual = self.model.prepare_visual(e, tok.media_starts, frame_ids, precompute=False)
            visual = replace(visual, window=MEDIA_ATTENTION[self.run.video.media_attention])
            logits = self.ddp(ids, pos, visual=visual, feed=feed, hooks=self.hooks)
        ce = F.cross_entropy(
            logits[0].to(torch.promote_types(logits.dtype, torch.float32)),
            labels,
            ignore_index=IGNORE,
            reduction="sum",
        )
        return ce, n_targets

    def backward(self, ce: torch.Tensor, n_targets: int) -> None:
        """Backward of the rank's loss share; DDP's mean over ranks is undone by the world-size
        factor."""
        (ce * (self.world / n_targets)).backward()

    def forward_backward(
        self, tok: Tokenized, features: torch.Tensor, frame_ids: torch.Tensor
    ) -> tuple[float, int]:
        """`forward` then `backward`; returns (this rank's summed CE, global number of targets)."""
        ce, n = self.forward(tok, features, frame_ids)
        self.backward(ce, n)
        return float(ce.detach()), n

    def optimizer_step(self) -> float:
        params = [p for _, p in self.params]
        norm = torch.nn.utils.clip_grad_norm_(
            params, self.run.train.grad_clip if self.run.train.grad_clip > 0 else float("inf")
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def train_step(self, sample: Sample) -> StepStats:
        t0 = time.perf_counter()
        feats, frame_ids, n_frames = self.video_features(sample.video)
        tok = tokenize(self.processor, sample.messages, n_frames)
        ce, n = self.forward_backward(tok, feats, frame_ids)
        lr = self.scheduler.get_last_lr()[0]
        norm = self.optimizer_step()
        total = self._all_sum(ce)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        mem = self._all_gather(peak_memory_bytes(self.device))
        st = StepStats(self.step, total / n, tok.input_ids.numel(), n_frames, dt, norm, lr, mem)
        self.history.append(
            {
                "step": st.step,
                "loss": st.loss,
                "seconds": dt,
                "tokens": st.tokens,
                "lr": lr,
                "grad_norm": norm,
                "peak_mem": mem,
            }
        )
        return st

    def _all_sum(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor(
            [x], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu"
        )
        dist.all_reduce(t)
        return float(t)

    def _all_gather(self, x: int) -> list[int]:
        if self.world == 1:
            return [x]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, x)
        return [int(v) for v in out]

    # ---- saving
    # ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        if self.rank == 0:
            save_checkpoint(self.run.train.out, self.model, self.run.model.path, self.state())
        if self.world > 1:
            dist.barrier()


def sample_order(n: int, step: int, seed: int) -> int:
    """Index of the sample for `step`: a fresh permutation per epoch, a pure function of (step,
    seed), so a resumed run sees exactly the samples the uninterrupted one would."""
    epoch, i = divmod(step, n)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return int(torch.randperm(n, generator=g)[i])


def _count(x: float) -> str:
    """1234 as is, 180000 as 180k: short enough for one progress line."""
    return f"{x:.0f}" if x < 10_000 else f"{x / 1000:.0f}k"


def _fmt_mem(mem: list[int]) -> str:
    """The largest rank's peak memory (one number, however many ranks)."""
    return f"{max(mem, default=0) / 2**30:.1f} GiB"


class _Reporter:
    """Rank 0's progress: a live rich bar on a terminal, else one plain line per step."""

    def __init__(self, total: int, start: int, live: Optional[bool]):
        self.console = Console(stderr=False, soft_wrap=True)
        self.total = total
        self.live = self.console.is_terminal if live is None else live
        self.bar = None
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]finetune"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task("finetune", total=total, completed=start, info="")

    def __call__(self, st: StepStats) -> None:
        """One step in under 80 columns: loss, gradient norm, rate, speed, frames, memory."""
        info = f"loss {st.loss:.4f}  {st.tokens_per_s:,.0f} tok/s  {_fmt_mem(st.peak_mem)}/rank"
        if self.bar is not None:
            self.bar.update(self.task, completed=st.step, info=info)
        else:
            line = (
                f"step {st.step}/{self.total}  loss {st.loss:.4f}  |g| {st.grad_norm:.4g}  "
                f"lr {st.lr:.1e}  {_count(st.tokens_per_s)} tok/s  {st.frames} fr  "
                f"{_fmt_mem(st.peak_mem)}"
            )
            self.console.print(line, highlight=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_losses(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Loss per step as a PNG (matplotlib, Agg backend)."""
    import matplotlib  # imported here: only rank 0 plots, once, at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [h["step"] for h in history],
        [h["loss"] for h in history],
        marker="." if len(history) < 50 else None,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (CE per assistant token)")
    ax.set_title("lvx finetune")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _say_if_replanned(trainer: Trainer, planned: int | None) -> None:
    """One line when a resumed run's --steps differ from the ones its schedule was made for."""
    steps = trainer.run.train.steps
    if trainer.rank != 0 or planned in (None, steps) or trainer.step >= steps:
        return
    lr = trainer.optimizer.param_groups[0]["lr"]
    low = trainer.run.train.lr * trainer.run.train.min_lr_ratio
    warnings.warn(
        f"resuming at step {trainer.step} a run planned for {planned} steps, now {steps}: the "
        f"learning rate goes on from {lr:.1e} down to {low:.1e} over the steps left",
        stacklevel=2,
    )


def run_training(
    run: Config,
    device: Optional[torch.device] = None,
    on_step: Optional[Callable[[StepStats], None]] = None,
) -> Trainer:
    """Train `run.train.steps` steps (from the saved step with `--resume`), save OUT, plot the
    losses on rank 0."""
    cfg = run.train
    samples = load_jsonl(cfg.data, cfg.video_dir)
    state = load_state(cfg.out) if cfg.resume else None
    model = run.model.path
    if state is not None and state.get("base_model") != model:
        raise ValueError(
            f"{cfg.out} was trained from {state.get('base_model')}, not {model}; pass that "
            "--model to resume"
        )
    trainer = Trainer(run, device, state)
    if state is not None:
        set_rng_state(state["rng"])
        _say_if_replanned(trainer, planned_steps(state))
    report = _Reporter(cfg.steps, trainer.step, cfg.progress) if trainer.rank == 0 else None
    try:
        while trainer.step < cfg.steps:
            st = trainer.train_step(samples[sample_order(len(samples), trainer.step, cfg.seed)])
            if report is not None:
                report(st)
            if cfg.save_every and trainer.step % cfg.save_every == 0 and trainer.step < cfg.steps:
                trainer.save()
            if on_step is not None:
                on_step(st)
    finally:
        if report is not None:
            report.close()
    trainer.save()
    if trainer.rank == 0 and cfg.plot and trainer.history:
        plot_losses(trainer.history, Path(cfg.out) / "loss.png")
    return trainer
