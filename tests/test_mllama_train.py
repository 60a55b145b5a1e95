"""Finetuning Llama-3.2-Vision as mPLUG-Owl3 is finetuned: sharded gradients with recompute equal
one process's, the loss falls on its template's answer tokens only, the saved checkpoint loads as
the published layout and gives the finetuned logits, and `lvx finetune` killed with SIGKILL after a
save resumes to the uninterrupted run's weights and losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import MESSAGES, N_FRAMES, VARIANTS, _all_variants, _assert_same, _cfg
from test_train_faults import SCRIPT
from timing import scaled

from lvx_app.train.data import IGNORE, tokenize
from lvx_app.train.loop import Trainer
from lvx_app.train.out_folder import STATE_FILE, save_checkpoint
from lvx_models.api import VIDEO, family_of
from lvx_models.mllama.tiny import write_tiny_checkpoint
from scripts.gloo_ranks import run_ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("mllama")))


def test_tokenize_puts_loss_on_answers_and_their_eot_only(checkpoint):
    _, _, proc = family_of(checkpoint).load(checkpoint)
    tok = tokenize(proc, MESSAGES, 3)
    chat = proc.build_chat_prompt(MESSAGES[:1], videos=[3])  # the video prompt chat would ask
    assert torch.equal(tok.input_ids[: chat.input_ids.numel()], chat.input_ids)
    eot = proc.stop_ids[0]
    targets = [int(x) for x in tok.labels if x != IGNORE]
    want = proc.encode_text("red and blue") + [eot] + proc.encode_text("it moves to the left")
    assert targets == want + [eot]
    assert tok.input_ids[-1] == eot and tok.labels[-1] == IGNORE
    assert tok.media_starts.tolist() == chat.media_starts


def test_trainable_groups(checkpoint):
    """hyper: each cross layer's k_proj, v_proj, k_norm and both gates; LoRA on every attention
    projection of the language model; all: the language model and the projector."""
    tr = Trainer(_cfg(checkpoint, train="hyper", dtype="float32"))
    names = [n.split("layers.")[1] for n, _ in tr.params]
    parts = ("cross_attn.k_proj.weight", "cross_attn.v_proj.weight", "cross_attn.k_norm.weight")
    want = [f"{i}.{p}" for i in (1, 3) for p in (*parts, "cross_attn_attn_gate")]
    assert sorted(names) == sorted(want + ["1.cross_attn_mlp_gate", "3.cross_attn_mlp_gate"])
    lora = Trainer(_cfg(checkpoint, train="lora", dtype="float32"))
    assert len(lora.params) == 5 * 4 * 2  # 5 layers, q/k/v/o, A and B
    every = Trainer(_cfg(checkpoint, train="all", dtype="float32"))
    assert every.projector_trains and not any("vision_model" in n for n, _ in every.params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "train,layout", [("lora", "striped"), ("all", "zigzag"), ("hyper", "contiguous")]
)
def test_sharded_gradients_equal_single_process(checkpoint, train, layout):
    """Two gloo ranks, K/V saved or recomputed in backward, layers checkpointed or not: the loss
    and every trainable gradient of one process's float64 step."""
    single = _all_variants(0, 1, checkpoint, train)
    ref = single[0]
    assert all(np.abs(g).max() > 0 for g in ref[1].values())  # every weight learns something
    for (rec, lm), got in zip(VARIANTS, single):
        for n in ref[1]:
            np.testing.assert_allclose(got[1][n], ref[1][n], rtol=1e-11, atol=1e-16, err_msg=n)
    per_rank = run_ranks(_all_variants, 2, checkpoint, train, layout)
    for v, (rec, lm) in enumerate(VARIANTS):
        ce = sum(r[v][0] for r in per_rank)
        for r in range(2):
            _assert_same((ce, per_rank[r][v][1]), ref, f"recompute={rec} checkpoint_lm={lm}")


def _logits(model, proc, frames: int = N_FRAMES) -> torch.Tensor:
    prompt = proc.build_chat_prompt([{"role": "user", "content": VIDEO + "what?"}], videos=[frames])
    e = torch.randn(
        frames,
        model.config.vision.num_patches,
        model.config.hidden_size,
        generator=torch.Generator().manual_seed(3),
        dtype=model.dtype,
    )
    visual = model.prepare_visual(e, torch.tensor(prompt.media_starts))
    with torch.no_grad():
        return model(prompt.input_ids[None], visual=visual)


def test_saved_checkpoint_loads_with_the_finetuned_logits(checkpoint, tmp_path):
    """LoRA adapters (made non-zero) merged into the published keys: `family_of(out).load` reads
    the folder and gives the logits of the model as trained (float64, adapters unmerged)."""
    tr = Trainer(_cfg(checkpoint, train="lora", dtype="float64"))
    with torch.no_grad():
        for i, (n, p) in enumerate(tr.params):
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
    out = save_checkpoint(tmp_path / "out", tr.model, checkpoint, {"step": 0}, torch.float64)
    family = family_of(out)
    assert family is family_of(checkpoint)
    model, _, proc = family.load(out, dtype=torch.float64)
    base, _, _ = family.load(checkpoint, dtype=torch.float64)
    want = _logits(tr.model, proc)
    torch.testing.assert_close(_logits(model, proc), want, rtol=1e-10, atol=1e-10)
    assert (_logits(base, proc) - want).abs().max() > 1e-3  # the adapters changed the answer


# --------------------------------------------------------------------------------------------------
# `lvx finetune` killed with SIGKILL, then resumed
# --------------------------------------------------------------------------------------------------

STEPS = 6


def _args(tmp_path: Path, video: str, model: str, out: Path, *extra: str) -> list[str]:
    data = tmp_path / "train.jsonl"
    rows = [
        {"video": os.path.basename(video), "question": "What is shown?", "answer": "A square."},
        {"video": os.path.basename(video), "question": "Colors?", "answer": "Red and blue."},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        *("--data", str(data), "--video-dir", os.path.dirname(video), "--model", model),
        *("--out", str(out), "--gpus", "0", "--ranks", "2", "--steps", str(STEPS)),
        *("--lora", "4", "--lr", "1e-2", "--cache-dir", str(tmp_path / "cache"), *extra),
    ]


def _finetune(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def _saved_step(out: Path) -> int:
    try:
        return int(torch.load(out / STATE_FILE, weights_only=False)["step"])
    except (FileNotFoundError, EOFError, RuntimeError):
        return 0


def _killed_after_a_save(args: list[str], out: Path, tmp_path: Path) -> int:
    """Run `lvx finetune` saving every step, SIGKILL it and its ranks once a step is saved; return
    the step the folder then holds."""
    err = tmp_path / "killed.err"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args],
        stdout=subprocess.DEVNULL,
        stderr=open(err, "w"),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,  # its own process group: the launcher and its ranks
    )
    try:
        deadline = time.monotonic() + scaled(240)
        while _saved_step(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step = _saved_step(out)
    assert 2 <= step < STEPS, f"killed at step {step}\n{err.read_text()}"
    return step


@pytest.mark.slow
def test_finetune_killed_with_sigkill_resumes_exactly(checkpoint, short_video, tmp_path):
    """Two CPU ranks: a run killed (kill -9, launcher and ranks) after saving a step and resumed
    with --resume ends with the uninterrupted run's trainable weights and loss history, bit for
    bit; the folder it leaves is a published checkpoint with the adapters merged."""
    part, got = assert_resumes_exactly(checkpoint, short_video, tmp_path)

    # the folder is a published checkpoint holding the trained weights, adapters merged
    model, _, _ = family_of(part).load(part, dtype=torch.float32)
    base, _, _ = family_of(checkpoint).load(checkpoint, dtype=torch.float32)
    key = "mllama.language_model.model.layers.1.cross_attn.k_proj"
    a, b = got["trainable"][f"{key}.lora_A"], got["trainable"][f"{key}.lora_B"]
    w = base.state_dict()[f"{key}.weight"]
    merged = (w + (8 / 4) * (b.float() @ a.float())).to(torch.bfloat16)  # alpha 2R, stored bf16
    torch.testing.assert_close(model.state_dict()[f"{key}.weight"], merged.float(), rtol=0, atol=0)
    assert not torch.equal(model.state_dict()[f"{key}.weight"], w)


def assert_resumes_exactly(checkpoint: str, short_video: str, tmp_path: Path) -> tuple[Path, dict]:
    """A finetuning run of `checkpoint` killed after a save and resumed equals the uninterrupted
    run (every family's resume test); returns the resumed run's folder and state."""
    full, part = tmp_path / "full", tmp_path / "part"
    _finetune(_args(tmp_path, short_video, checkpoint, full, "--save-every", "0"))
    args = _args(tmp_path, short_video, checkpoint, part, "--save-every", "1")
    killed_at = _killed_after_a_save(args, part, tmp_path)
    _finetune([*args, "--resume"])
    want = torch.load(full / STATE_FILE, weights_only=False)
    got = torch.load(part / STATE_FILE, weights_only=False)
    assert got["step"] == want["step"] == STEPS and killed_at < STEPS
    assert [h["step"] for h in got["history"]] == list(range(1, STEPS + 1))
    losses = [h["loss"] for h in want["history"]]
    assert [h["loss"] for h in got["history"]] == losses
    assert losses[-1] < losses[0]
    assert set(got["trainable"]) == set(want["trainable"])
    for n, t in want["trainable"].items():
        assert torch.equal(got["trainable"][n], t), n
    return part, got
