"""Finetuning: sharded gradients equal one process's, recompute equals saving K/V (and saves no
K/V), training lowers the loss, the saved checkpoint loads and answers, resume continues exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_configs import engine_config, train_config
from timing import scaled

from lvx_app.parallel.layout import owned
from lvx_app.train.data import IGNORE, DataError, load_jsonl, tokenize
from lvx_app.train.loop import Trainer, run_training
from scripts.gloo_ranks import run_ranks

MESSAGES = [
    {"role": "user", "content": "<|video|>\nwhat color is the square?"},
    {"role": "assistant", "content": "red and blue"},
    {"role": "user", "content": "and then?"},
    {"role": "assistant", "content": "it moves to the left"},
]
N_FRAMES = 5
VARIANTS = [(False, False), (True, False), (True, True)]  # (recompute, checkpoint_lm)


def _cfg(checkpoint: str, **kw):
    return train_config(checkpoint, **{"dtype": "float64", "lora_rank": 4, **kw})


def _grads(
    rank: int,
    world: int,
    checkpoint: str,
    train: str,
    recompute: bool,
    checkpoint_lm: bool,
    layout: str = "contiguous",
    media: str = "every-frame-before",
):
    """(summed CE of this rank, {param: grad}) for one fixed sample; frames and tokens dealt by
    `layout`; `media`: `--media-attention`."""
    options = dict(recompute=recompute, checkpoint_lm=checkpoint_lm, layout=layout)
    tr = Trainer(_cfg(checkpoint, train=train, media_attention=media, **options))
    with torch.no_grad():  # non-zero LoRA B so every adapter weight gets a gradient
        for i, (n, p) in enumerate(tr.params):
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    tok = tokenize(tr.processor, MESSAGES, N_FRAMES)
    e = torch.randn(
        N_FRAMES,
        tr.model_config.vision.num_patches,
        _feature_width(tr),
        generator=torch.Generator().manual_seed(1),
        dtype=torch.float64,
    )
    ids = torch.tensor(owned(N_FRAMES, world, rank, layout), dtype=torch.int64)
    ce, _ = tr.forward_backward(tok, e[ids], ids)
    return ce, {n: p.grad.numpy().copy() for n, p in tr.params}


def _feature_width(tr: Trainer) -> int:
    """The width of what the training step gets per visual token: the tower's features when the
    projector trains, else the projector's output."""
    if not tr.projector_trains:
        return tr.model_config.hidden_size
    size = tr.processor.image_size
    with torch.no_grad():
        return tr.model.vision_features(torch.zeros(1, 3, size, size)).shape[-1]


def _all_variants(rank: int, world: int, checkpoint: str, train: str, *options: str):
    """Every variant's `_grads`; `options`: the layout, then `--media-attention`."""
    return [_grads(rank, world, checkpoint, train, r, c, *options) for r, c in VARIANTS]


def _assert_same(got, ref, what: str):
    assert got[0] == pytest.approx(ref[0], rel=1e-12), what
    assert set(got[1]) == set(ref[1])
    for n in ref[1]:
        np.testing.assert_allclose(
            got[1][n], ref[1][n], rtol=1e-9, atol=1e-13, err_msg=f"{what}: {n}"
        )


@pytest.mark.parametrize(
    "generation,train,world,layout",
    [
        ("g1", "lora", 2, "striped"),
        ("g2", "all", 3, "zigzag"),
        ("g1-gateproj", "hyper", 2, "contiguous"),
    ],
)
@pytest.mark.slow
def test_sharded_gradients_equal_single_process(tiny_checkpoints, generation, train, world, layout):
    ckpt = tiny_checkpoints[generation]
    single = _all_variants(0, 1, ckpt, train)
    ref = single[0]  # one process, K/V saved
    assert any(np.abs(g).max() > 0 for g in ref[1].values())
    if (
        generation == "g1-gateproj"
    ):  # --train hyper trains the 240728 gate_proj, and it gets a gradient
        gate = [n for n in ref[1] if ".self_attn.gate_proj.0." in n]
        assert len(gate) == 4 and all(np.abs(ref[1][n]).max() > 0 for n in gate)
    for (rec, lm), got in zip(VARIANTS, single):
        for n in ref[
            1
        ]:  # recompute (and checkpointing) give the same gradients up to float64 summation order
            np.testing.assert_allclose(
                got[1][n],
                ref[1][n],
                rtol=1e-11,
                atol=1e-16,
                err_msg=f"recompute={rec} checkpoint_lm={lm}: {n}",
            )
    per_rank = run_ranks(_all_variants, world, ckpt, train, layout)
    for v, (rec, lm) in enumerate(VARIANTS):
        ce = sum(r[v][0] for r in per_rank)
        for r in range(world):  # DDP leaves every rank with the full gradient
            _assert_same(
                (ce, per_rank[r][v][1]), ref, f"{world} ranks, recompute={rec}, checkpoint_lm={lm}"
            )


def test_latest_frame_training_on_ranks_equals_one_process(tiny_checkpoints):
    """`--media-attention latest-frame` in finetuning: each variant (K/V saved, recomputed,
    checkpointed) on 2 zigzag ranks gives one process's gradients, and they differ from the
    default mask's (the window is applied)."""
    ckpt = tiny_checkpoints["g2"]
    single = _all_variants(0, 1, ckpt, "hyper", "contiguous", "latest-frame")
    default = _grads(0, 1, ckpt, "hyper", False, False, "contiguous")
    assert any(not np.allclose(default[1][n], single[0][1][n]) for n in default[1])
    per_rank = run_ranks(_all_variants, 2, ckpt, "hyper", "zigzag", "latest-frame")
    for v, (rec, lm) in enumerate(VARIANTS):
        ce = sum(r[v][0] for r in per_rank)
        for r in range(2):
            _assert_same((ce, per_rank[r][v][1]), single[0], f"latest, recompute={rec} lm={lm}")


def test_lora_on_gate_proj_is_written_back_in_the_240728_layout(tiny_checkpoints, tmp_path):
    """LoRA wraps the Linear inside gate_proj; the saved checkpoint has it merged under the official
    key `gate_proj.0.weight`, is read back as the same generation, and holds the trained weight."""
    from lvx_app.train.out_folder import save_checkpoint
    from lvx_models.mplug_owl3.loader import load_model

    ckpt = tiny_checkpoints["g1-gateproj"]
    tr = Trainer(_cfg(ckpt, train="lora", dtype="float32"))
    key = "language_model.model.layers.0.self_attn.gate_proj.0"
    assert f"{key}.lora_A" in dict(tr.params)
    with torch.no_grad():
        dict(tr.params)[f"{key}.lora_B"].normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    adapter = dict(tr.model.named_modules())[key]
    mask = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "out", tr.model, ckpt, {"step": 0}, dtype=torch.float32)
    finally:
        os.umask(mask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # readable by others, as any new file
    model, cfg, _ = load_model(tmp_path / "out")
    assert cfg.form == "g1-gateproj"
    w = model.state_dict()[f"{key}.weight"]
    torch.testing.assert_close(w, adapter.merged_weight(), rtol=0, atol=0)
    assert not torch.equal(w, adapter.base.weight)


def _saved_and_forwards(checkpoint: str, recompute: bool, checkpoint_lm: bool):
    """Saved-tensor elements with a visual-token dimension (besides E itself), and attention forward
    rings run."""
    import lvx_app.train.recompute as rc

    tr = Trainer(
        _cfg(
            checkpoint,
            train="hyper",
            recompute=recompute,
            checkpoint_lm=checkpoint_lm,
            dtype="float32",
        )
    )
    tok = tokenize(tr.processor, MESSAGES, N_FRAMES)
    e = torch.randn(N_FRAMES, tr.model_config.vision.num_patches, tr.model_config.hidden_size)
    s_kv = N_FRAMES * tr.model_config.vision.num_patches
    saved = []
    calls = []
    inner = rc.lv_xattn_forward

    def counting(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)

    def pack(t):
        if t.data_ptr() != e.data_ptr() and s_kv in t.shape:
            saved.append(t.numel())
        return t

    rc.lv_xattn_forward = counting
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ce, n = tr.forward(tok, e, torch.arange(N_FRAMES))
        tr.backward(ce, n)
    finally:
        rc.lv_xattn_forward = inner
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in tr.params)
    return sum(saved), len(calls)


def test_recompute_keeps_no_visual_kv_and_checkpointing_runs_attention_once(tiny_checkpoints):
    ckpt = tiny_checkpoints["g2"]
    cfg = _cfg(ckpt)
    layers, hyper = 4, 2  # the tiny config: 4 layers, 2 of them hyper
    saved_plain, calls_plain = _saved_and_forwards(ckpt, recompute=False, checkpoint_lm=False)
    saved_rec, calls_rec = _saved_and_forwards(ckpt, recompute=True, checkpoint_lm=False)
    saved_lm, calls_lm = _saved_and_forwards(ckpt, recompute=True, checkpoint_lm=True)
    # without recompute, normed E and K/V of every hyper layer are kept
    assert cfg.train.recompute and saved_plain > 0
    # with it, nothing of visual-token length but the one shared E
    assert saved_rec == 0 and saved_lm == 0
    # checkpointed layers replay attention
    assert calls_plain == calls_rec == calls_lm == layers + hyper


def test_a_training_forward_without_its_feed_is_refused(tiny_checkpoints):
    """Training attention gets how the ranks feed a forward's tokens with the forward
    (`TrainAttention.feed`); a forward without it (read as replicated) would attend without
    gradients through the rings: refused in one line."""
    tr = Trainer(_cfg(tiny_checkpoints["g2"], train="hyper", dtype="float32"))
    ids = torch.randint(0, tr.model_config.vocab_size, (1, 6))
    pos = torch.arange(6).view(1, -1)
    with pytest.raises(RuntimeError, match="feed=TrainAttention.feed"):
        tr.model(ids, pos, hooks=tr.hooks)
    feed = tr.hooks.feed(pos, torch.device("cpu"))
    got = tr.model(ids, pos, feed=feed, hooks=tr.hooks)
    # without hooks=, one process's own attention
    assert feed.sizes == (6,)
    torch.testing.assert_close(got, tr.model(ids, pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["g1-gateproj", "g1", "g2"])
def test_tokenize_puts_loss_on_answers_only(tiny_checkpoints, form):
    from lvx_models.mplug_owl3.processor import Owl3Processor

    proc = Owl3Processor.from_pretrained(tiny_checkpoints[form])
    tok = tokenize(proc, MESSAGES, 3)
    chat = proc.build_chat_prompt(MESSAGES[:1], videos=[3])  # the video prompt chat would ask
    video_turn = chat.input_ids[: chat.media_starts[-1] + chat.placeholder_len]
    assert torch.equal(tok.input_ids[: len(video_turn)], video_turn)
    text = proc.decode(tok.input_ids, skip_special_tokens=False)
    assert ("<|start_video_frame|>" in text) == proc.rules.video_span == (form != "g1-gateproj")
    targets = [int(x) for x in tok.labels if x != IGNORE]
    expected = (
        proc.encode("red and blue<|im_end|>")
        + proc.encode("<|endoftext|>")
        + proc.encode("it moves to the left<|im_end|>")
        + proc.encode("<|endoftext|>")
    )
    assert targets == expected
    assert tok.labels[-1] == IGNORE and tok.input_ids[-1] == proc.encode("<|endoftext|>")[0]
    assert len(tok.media_starts) == 3
    ids = tok.input_ids.tolist()
    assert all(
        ids[s : s + len(proc.encode("<|image|>"))] == proc.encode("<|image|>")
        for s in tok.media_starts.tolist()
    )


def test_load_jsonl_formats_and_errors(tmp_path, short_video):
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps({"video": short_video, "question": ["a?", "b?"], "answer": ["x", "y"]})
        + "\n\n"
        + json.dumps(
            {
                "video": short_video,
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
            }
        )
        + "\n"
    )
    s = load_jsonl(f)
    assert [m["role"] for m in s[0].messages] == ["user", "assistant"] * 2
    assert (
        s[0].messages[0]["content"] == "<|video|>\na?"
        and s[1].messages[0]["content"] == "<|video|>\nq"
    )
    f.write_text(json.dumps({"video": "missing.mp4", "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match="d.jsonl:1: video .* not found"):
        load_jsonl(f)
    f.write_text(json.dumps({"video": short_video, "question": "q"}) + "\n")
    with pytest.raises(DataError, match="needs 'conversations', or 'question' and 'answer'"):
        load_jsonl(f)


def _write_data(tmp_path, video: str):
    f = tmp_path / "train.jsonl"
    rows = [
        {
            "video": os.path.basename(video),
            "question": "What is shown?",
            "answer": "A red square moving.",
        },
        {
            "video": os.path.basename(video),
            "conversations": [
                {"from": "human", "value": "Colors?"},
                {"from": "gpt", "value": "Red and blue."},
            ],
        },
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.mark.slow
def test_train_save_load_answer_and_resume(tiny_checkpoints, short_video, tmp_path):
    from lvx_app.runtime.open import open_engine
    from lvx_models.mplug_owl3.loader import load_model
    from lvx_models.mplug_owl3.saving import official_state_dict

    data = _write_data(tmp_path, short_video)
    common = dict(
        data=str(data),
        video_dir=os.path.dirname(short_video),
        lr=1e-2,
        train="lora",
        lora_rank=8,
        cache_dir=str(tmp_path / "cache"),
        decode_workers=1,
        progress=False,
    )
    ckpt = tiny_checkpoints["g2"]
    full = run_training(train_config(ckpt, out=str(tmp_path / "full"), steps=6, **common))
    losses = [h["loss"] for h in full.history]
    assert len(losses) == 6 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.05, losses
    assert (tmp_path / "full" / "loss.png").stat().st_size > 0

    # the checkpoint is the official layout with LoRA merged: load_model reads it and gets the
    # trained weights
    model, _, _ = load_model(tmp_path / "full")
    # the tiny checkpoint is stored in bf16
    trained = official_state_dict(full.model, torch.bfloat16)
    loaded = model.state_dict()
    assert set(loaded) == set(trained)
    q = "language_model.model.layers.1.self_attn.v_kv_proj.weight"
    assert torch.equal(loaded[q].to(torch.bfloat16), trained[q])
    base = load_model(tiny_checkpoints["g2"])[0].state_dict()
    assert not torch.equal(base[q], loaded[q])

    engine = open_engine(engine_config(tmp_path / "full", tmp_path / "cache"))
    try:
        engine.load_video(short_video)
        answer = "".join(engine.ask("What is shown?", max_new_tokens=6))
        assert engine.last_answer.new_tokens >= 1 and isinstance(answer, str)
    finally:
        engine.close()

    # a run saving every 3 steps dies after step 4; resuming it gives the uninterrupted run's losses
    # and weights
    class Killed(Exception):
        pass

    def die(st):
        if st.step == 4:
            raise Killed

    with pytest.raises(Killed):
        part = train_config(ckpt, out=str(tmp_path / "part"), steps=6, save_every=3, **common)
        run_training(part, on_step=die)
    again = train_config(ckpt, out=str(tmp_path / "part"), steps=6, resume=True, **common)
    resumed = run_training(again)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([h["loss"] for h in resumed.history], losses, rtol=1e-5)
    for n, t in full.trainable_state().items():
        torch.testing.assert_close(resumed.trainable_state()[n], t, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_finetune_command_on_two_ranks(tiny_checkpoints, short_video, tmp_path):
    """`lvx finetune`'s function through a torchrun group of 2 CPU ranks."""
    data = _write_data(tmp_path, short_video)
    script = (
        "import typer, sys\nfrom lvx_app.cli.finetune import finetune_command\napp = "
        "typer.Typer()\n"
        "app.command()(finetune_command)\napp(sys.argv[1:])\n"
    )
    args = [
        "--data",
        str(data),
        "--video-dir",
        os.path.dirname(short_video),
        "--model",
        tiny_checkpoints["g1"],
        "--out",
        str(tmp_path / "out"),
        "--gpus",
        "0",
        "--ranks",
        "2",
        "--steps",
        "2",
        "--lora",
        "4",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=scaled(240),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 2/2  loss" in proc.stdout
    assert (tmp_path / "out" / "model.safetensors").exists() and (
        tmp_path / "out" / "loss.png"
    ).exists()
    assert not (tmp_path / "out" / ".lvx-finetune.lock").exists()  # a finished run's lock goes
    bad = subprocess.run(
        [sys.executable, "-c", script, *args[:-2], "--train", "all"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert bad.returncode == 2 and "use either --lora R or --train" in bad.stderr
    again = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=scaled(60)
    )
    assert again.returncode == 2 and "already holds a finetuning run; pass --resume" in again.stderr


def test_a_resumed_run_with_more_steps_never_raises_the_learning_rate_again():
    """Planned for 6 steps and resumed with --steps 10 (or 20 from step 4): the rate goes on down
    from where it was, to the floor, as the warm-up and cosine of the first plan left it."""
    from lvx_app.config import TrainConfig
    from lvx_app.train.loop import lr_schedule, planned_steps

    for planned, resumed_at, steps in ((6, 6, 10), (10, 4, 20), (6, 3, 4)):
        first = lr_schedule(TrainConfig(steps=planned))
        again = lr_schedule(TrainConfig(steps=steps), planned=planned, resumed_at=resumed_at)
        before = [first(s) for s in range(resumed_at)]
        after = [again(s) for s in range(resumed_at, steps)]
        assert [again(s) for s in range(resumed_at)] == before, "the steps already run keep theirs"
        assert all(b <= a + 1e-12 for a, b in zip([first(resumed_at - 1), *after], after)), after
        assert after[-1] == pytest.approx(0.1, abs=0.05) or steps == 4
    unchanged = lr_schedule(TrainConfig(steps=6), planned=6, resumed_at=3)
    assert [unchanged(s) for s in range(6)] == [
        lr_schedule(TrainConfig(steps=6))(s) for s in range(6)
    ]
    assert planned_steps({"planned_steps": 6}) == 6
    assert planned_steps({"config": {"train": {"steps": 7}}}) == 7
    assert planned_steps({"config": {"steps": 8}}) == 8 and planned_steps({}) is None


def test_both_families_finetune_and_one_without_saved_weights_is_refused(tmp_path, monkeypatch):
    """mPLUG-Owl3 and Llama-3.2-Vision both write their finetuned weights back; a family lvx cannot
    write them for (no `save_weights`) is refused in one line, before any model is loaded."""
    from dataclasses import replace

    from lvx_app.train.out_folder import family_to_finetune
    from lvx_models.api import FAMILIES, CheckpointError

    family = FAMILIES["mllama"]
    ckpt = family.write_tiny(tmp_path / "tiny-mllama", family.generations[0].name)
    assert family_to_finetune(ckpt) is family
    assert family_to_finetune(FAMILIES["mplug_owl3"].write_tiny(tmp_path / "owl3", "g2"))
    monkeypatch.setitem(FAMILIES, "mllama", replace(family, save_weights=None))
    with pytest.raises(CheckpointError, match="finetuning Llama-3.2-Vision is not supported yet"):
        family_to_finetune(ckpt)
