"""OpenFlamingo behind the family surface: its published three-part layout read safely, the
factory's added tokens, the published prompt format, the CLIP `openai` frame preparation, the
parts fetched by hub id where a folder lacks them, and every front door on the tiny checkpoint
(`lvx.open` and `lvx chat` over 2 CPU ranks with evidence, `lvx demo --model-family
openflamingo`, a finetuning run that resumes exactly after kill -9)."""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_configs import engine_config
from PIL import Image
from typer.testing import CliRunner
from videos import make_video

import lvx_app as lvx
from lvx_app.cli.main import app
from lvx_models.api import FAMILIES, VIDEO, CheckpointError, family_of
from lvx_models.openflamingo import checkpoint as layout
from lvx_models.openflamingo.frames import OPENAI_MEAN, OPENAI_STD, resize_crop_uint8
from lvx_models.openflamingo.processor import FlamingoProcessor
from lvx_models.openflamingo.tiny import write_tiny_checkpoint
from lvx_models.openflamingo.tokenizer import FlamingoTokenizer
from scripts.gloo_ranks import run_ranks

FAMILY = FAMILIES["openflamingo"]
QUESTION = "What happens in this video?"
EVIDENCE_QUESTION = "what happens in the video?"  # test_evidence's one-process reference asks it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(FAMILY.write_tiny(tmp_path_factory.mktemp("openflamingo") / "tiny", "v2"))


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    """6 s at 4 fps: 6 frames at 1 fps."""
    folder = tmp_path_factory.mktemp("videos")
    return str(make_video(folder / "clip.mp4", num_frames=24, fps=4, width=64, height=48))


# ---- the published layout ------------------------------------------------------------------------
def test_checkpoint_pt_holds_what_open_flamingo_saves(checkpoint):
    """A plain state dict, loadable with weights_only: the perceiver, each block's gated cross
    layer under its `FlamingoLayer` name, and the embeddings resized to the tokenizer with the
    three tokens the factory adds; nothing of the vision tower or the MPT blocks."""
    state = torch.load(Path(checkpoint) / "checkpoint.pt", weights_only=True)
    assert isinstance(state, OrderedDict)
    blocks = {int(m.group(1)) for k in state if (m := re.match(r".*blocks\.(\d+)\.gated", k))}
    assert blocks == {0, 1, 2, 3}
    assert all(
        k.startswith("perceiver.")
        or ".gated_cross_attn_layer." in k
        or k == "lang_encoder.transformer.wte.weight"
        for k in state
    )
    assert "perceiver.latents" in state and state["perceiver.latents"].shape[0] == 64
    tok = FlamingoTokenizer.from_pretrained(checkpoint)
    assert state["lang_encoder.transformer.wte.weight"].shape[0] == len(tok)
    text = torch.load(Path(checkpoint) / "pytorch_model.bin", weights_only=True)
    assert "transformer.blocks.0.ln_1.weight" in text  # MPT-1B's own (mosaic_gpt) names
    assert text["transformer.wte.weight"].shape[0] > len(tok)  # padded, as MPT's 50,432 rows
    model, _, _ = FAMILY.load(checkpoint)  # the files hold every tensor the model loads
    assert len(layout.weight_files(Path(checkpoint))) == len(model.flamingo.state_dict())


class _Payload:
    """A pickle that would run code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_an_arbitrary_pickle_is_refused_and_never_runs(checkpoint, tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    for f in Path(checkpoint).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "ran"
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    torch.save({**state, "perceiver.latents": _Payload(marker)}, folder / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a PyTorch weight file of tensors only"):
        FAMILY.load(folder)
    assert not marker.exists()
    with open(folder / "checkpoint.pt", "wb") as f:
        pickle.dump({"a": 1}, f)
    with pytest.raises(CheckpointError):
        FAMILY.inspect(folder)


def test_the_factory_adds_its_tokens_after_the_vocabulary(checkpoint, tmp_path):
    """`<|endofchunk|>`, `<image>`, then `<PAD>` (the tokenizer names no pad token), as
    open_flamingo's factory adds them; a tokenizer that names its pad token gets no `<PAD>`."""
    tok = FlamingoTokenizer.from_pretrained(checkpoint)
    n = tok.tok.get_vocab_size(with_added_tokens=True) - 3
    assert (tok.eoc_id, tok.image_id, tok.pad_id) == (n, n + 1, n + 2)
    assert tok.stop_ids == (tok.eoc_id, 0)  # then GPT-NeoX's <|endoftext|>
    assert tok.encode("<image>Question:")[0] == tok.image_id
    assert tok.image_id not in tok.encode_text("<image>")  # typed by a user: plain text
    named = tmp_path / "named"
    named.mkdir()
    for f in ("tokenizer.json", "special_tokens_map.json"):
        (named / f).write_bytes((Path(checkpoint) / f).read_bytes())
    (named / "tokenizer_config.json").write_text('{"pad_token": "<|padding|>"}')
    padded = FlamingoTokenizer.from_pretrained(named)
    assert len(padded) == len(tok) - 1 and padded.pad_id == 1


def test_the_prompt_is_the_published_vqa_format(checkpoint):
    proc = FAMILY.load(checkpoint).processor
    chat = proc.build_chat_prompt([{"role": "user", "content": f"{VIDEO}\n{QUESTION}"}], videos=[3])
    assert chat.text == f"<image><image><image>Question:{QUESTION} Short answer:"
    assert chat.media_starts == [0, 1, 2] and chat.placeholder_len == 1
    assert proc.decode(chat.input_ids, skip_special_tokens=False) == chat.text
    messages = [
        {"role": "user", "content": f"{VIDEO}\nWhat?"},
        {"role": "assistant", "content": "a dog"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "it runs"},
    ]
    prompt, spans = proc.training_prompt(messages, videos=[2])
    assert prompt.text == (
        "<image><image>Question:What? Short answer:a dog<|endofchunk|>"
        "Question:And then? Short answer:it runs<|endofchunk|>"
    )
    said = [proc.decode(prompt.input_ids[a:b], skip_special_tokens=False) for a, b in spans]
    assert said == ["a dog<|endofchunk|>", "it runs<|endofchunk|>"]
    first = proc.build_chat_prompt(messages[:1], videos=[2]).input_ids
    follow = proc.build_followup("And then?", offset=0).input_ids
    answer = proc.encode_text("a dog") + [proc.stop_ids[0]]
    answered = torch.tensor(proc.encode_text("it runs"))
    whole = torch.cat([first, torch.tensor(answer), follow, answered])
    assert torch.equal(whole, prompt.input_ids[: whole.numel()])


def test_a_subtitled_prompt_is_a_prefix_of_its_question(checkpoint):
    """The engine prefills the video prompt before the question (all but its closing
    `<|endofchunk|>`): the question's prompt must start with those ids."""
    proc = FAMILY.load(checkpoint).processor
    opening = [{"role": "user", "content": f"{VIDEO}\n[0:01] a red square\n"}]
    loaded = proc.build_chat_prompt(opening, videos=[4], add_generation_prompt=False)
    assert loaded.input_ids[-1] == proc.stop_ids[0]
    asked = [{"role": "user", "content": opening[0]["content"] + QUESTION}]
    full = proc.build_chat_prompt(asked, videos=[4]).input_ids
    assert torch.equal(full[: loaded.input_ids.numel() - 1], loaded.input_ids[:-1])


def test_frames_are_prepared_as_open_clips_openai_transform():
    """Shorter side to S (bicubic), center crop, /255, openai mean/std: within 2 grey levels of
    PIL's `Resize(S)` + `CenterCrop(S)` (torchvision's arithmetic) on a landscape and a portrait
    frame."""
    rng = np.random.default_rng(0)
    for h, w in ((48, 80), (90, 50)):
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ours = resize_crop_uint8(frame[None], 28)[0].permute(1, 2, 0).numpy().astype(int)
        short = 28
        new = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
        pil = Image.fromarray(frame).resize((new[1], new[0]), Image.BICUBIC)
        top, left = int(round((new[0] - 28) / 2.0)), int(round((new[1] - 28) / 2.0))
        want = np.asarray(pil.crop((left, top, left + 28, top + 28))).astype(int)
        assert np.abs(ours - want).max() <= 2
    proc = FlamingoProcessor(None, 28)
    x = proc.frame_prep.pixel_values(torch.full((1, 40, 40, 3), 255, dtype=torch.uint8))
    want = [(1 - m) / s for m, s in zip(OPENAI_MEAN, OPENAI_STD)]
    assert torch.allclose(x[0, :, 0, 0], torch.tensor(want), atol=1e-6)


def test_both_release_forms_load_and_name_their_parts(tmp_path):
    """The 3B form (MPT-1B's `mosaic_gpt` names, QK LayerNorm, a cross layer before every block)
    and the 9B form (MPT-7B's `mpt` names, one before every 4th) read into the same module tree;
    `lvx info` names the family and the layers."""
    from lvx_app.cli.info import checkpoint_rows

    for form, layers in (("3B", [0, 1, 2, 3]), ("9B", [3, 7])):
        folder = write_tiny_checkpoint(tmp_path / form, form=form)
        assert family_of(folder) is FAMILY
        model, config, _ = FAMILY.load(folder)
        assert config.cross_layer_indices == layers and config.text.qk_ln == (form == "3B")
        rows = checkpoint_rows(str(folder))
        assert rows["family"] == "OpenFlamingo (openflamingo)"
        assert rows["cross-attention layers (0-based)"] == ", ".join(map(str, layers))
    assert layout.mpt_key("transformer.blocks.3.mlp.mlp_up.weight") == (
        "lang_encoder.transformer.blocks.3.decoder_layer.ffn.up_proj.weight"
    )
    old = "module.lang_encoder.gated_cross_attn_layers.7.ff_gate"  # open_flamingo 1's, under DDP
    want = "lang_encoder.transformer.blocks.7.gated_cross_attn_layer.ff_gate"
    assert layout.flamingo_key(old) == want


def test_a_lone_checkpoint_pt_fetches_its_release_parts_by_hub_id(
    checkpoint, tmp_path, monkeypatch
):
    """A folder with only the release's `checkpoint.pt` (as `openflamingo/OpenFlamingo-3B-vitl-
    mpt1b` holds it) takes the vision and text files from the repos the release names, fetching
    only the files lvx reads; an MPT folder without `checkpoint.pt` is one line."""
    import huggingface_hub

    lone = tmp_path / "release"
    lone.mkdir()
    wte = "lang_encoder.transformer.wte.weight"
    torch.save({wte: torch.zeros(4, 2048)}, lone / "checkpoint.pt")
    asked = []

    def snapshot(repo, revision=None, allow_patterns=None, local_files_only=False):
        asked.append((repo, tuple(allow_patterns)))
        return str(lone) if repo.startswith("openflamingo/") else checkpoint

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    parts = layout.resolve_parts("openflamingo/OpenFlamingo-3B-vitl-mpt1b")
    assert parts.flamingo == lone and parts.vision == parts.text == Path(checkpoint)
    assert asked == [
        ("openflamingo/OpenFlamingo-3B-vitl-mpt1b", layout.HUB_FILES),
        ("timm/vit_large_patch14_clip_224.openai", layout.VISION_HUB_FILES),
        ("anas-awadalla/mpt-1b-redpajama-200b", layout.TEXT_HUB_FILES),
    ]
    assert layout.resolve_parts(lone) == parts  # a local folder holding only checkpoint.pt
    torch.save({wte: torch.zeros(4, 64)}, lone / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="matches no published OpenFlamingo"):
        layout.resolve_parts(lone)
    text_only = tmp_path / "mpt"
    text_only.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (text_only / f).write_bytes((Path(checkpoint) / f).read_bytes())
    with pytest.raises(CheckpointError, match="holds no checkpoint.pt"):
        family_of(text_only).load(text_only)
    torch.save({wte: torch.zeros(4, 2048)}, lone / "checkpoint.pt")
    pickled, empty = tmp_path / "vision-without-safetensors", tmp_path / "nothing-asked-for"
    pickled.mkdir()
    empty.mkdir()
    (pickled / "open_clip_pytorch_model.bin").touch()
    asked.clear()

    def resolve(repo, revision, files):  # the vision repo as timm's holds it: no safetensors
        asked.append((repo, tuple(files)))
        if not str(repo).startswith("timm/"):
            return lone
        return pickled if "open_clip_pytorch_model.bin" in files else empty

    monkeypatch.setattr(layout, "resolve_checkpoint", resolve)
    assert layout.resolve_parts(lone).vision == pickled
    vision = "timm/vit_large_patch14_clip_224.openai"
    assert asked[1:3] == [
        (vision, layout.VISION_HUB_FILES),  # safetensors, where the repo has them
        (vision, ("open_clip_config.json", "open_clip_pytorch_model.bin")),  # else its .bin
    ]


def test_clip_weights_as_a_pytorch_file_load_the_same_tower(checkpoint, tmp_path):
    """A vision repo without safetensors: `open_clip_pytorch_model.bin` (read with weights_only)
    gives the same tower; without `open_clip_config.json` the sizes are open_clip's ViT-L-14 with
    QuickGELU, the `openai` tower every release names."""
    from safetensors.torch import load_file

    from lvx_models.openflamingo.config import VisionConfig
    from lvx_models.openflamingo.folder_config import vision_config

    folder = tmp_path / "bin"
    folder.mkdir()
    for f in Path(checkpoint).iterdir():
        if f.name != "open_clip_model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    clip = load_file(str(Path(checkpoint) / "open_clip_model.safetensors"))
    torch.save(clip, folder / "open_clip_pytorch_model.bin")
    frames = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    want = FAMILY.load(checkpoint).model.encode_images(frames)
    torch.testing.assert_close(FAMILY.load(folder).model.encode_images(frames), want)
    (folder / "open_clip_config.json").unlink()
    assert vision_config(folder) == VisionConfig(image_size=224, patch_size=14, width=1024,
                                                 layers=24, heads=16, quick_gelu=True)  # fmt: skip


def test_saved_weights_load_with_the_finetuned_logits(checkpoint, tmp_path):
    """LoRA adapters (made non-zero) merged: the folder finetuning writes (every tensor in
    model.safetensors beside the base's other files) loads, alone, to the trained logits."""
    from test_train import _cfg

    from lvx_app.train.loop import Trainer
    from lvx_app.train.out_folder import save_checkpoint

    tr = Trainer(_cfg(checkpoint, train="lora", dtype="float64"))
    with torch.no_grad():
        for i, (n, p) in enumerate(tr.params):
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
    out = save_checkpoint(tmp_path / "out", tr.model, checkpoint, {"step": 0}, torch.float64)
    assert family_of(out) is FAMILY
    model, _, proc = FAMILY.load(out, dtype=torch.float64)
    base, _, _ = FAMILY.load(checkpoint, dtype=torch.float64)

    def logits(m):
        prompt = proc.build_chat_prompt([{"role": "user", "content": VIDEO + "what?"}], videos=[2])
        e = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(3), dtype=m.dtype)
        with torch.no_grad():
            return m(prompt.input_ids[None], visual=m.prepare_visual(e, torch.tensor([0, 1])))

    want = logits(tr.model)
    torch.testing.assert_close(logits(model), want, rtol=1e-10, atol=1e-10)
    assert (logits(base) - want).abs().max() > 1e-3


def test_the_features_fingerprint_follows_the_tower_and_perceiver_only(checkpoint, tmp_path):
    """The feature cache's key changes with the perceiver's weights, not with a cross layer's;
    a memo of the files' digests gives the same key."""
    folder = tmp_path / "copy"
    folder.mkdir()
    for f in Path(checkpoint).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    memo: dict[str, str] = {}
    path, base = FAMILY.encoder_identity(str(folder), None, memo)
    assert path == str(folder.resolve()) and memo
    assert FAMILY.encoder_identity(str(folder), None, memo)[1] == base
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    state["lang_encoder.transformer.blocks.0.gated_cross_attn_layer.ff_gate"] += 1
    torch.save(state, folder / "checkpoint.pt")
    assert FAMILY.encoder_identity(str(folder), None, memo)[1] == base
    state["perceiver.latents"][0, 0] += 1
    torch.save(state, folder / "checkpoint.pt")
    assert FAMILY.encoder_identity(str(folder), None, memo)[1] != base


# ---- every front door on the tiny checkpoint ----------------------------------------------------
def _answers(rank: int, world: int, checkpoint: str, video: str):
    """Every rank answers one question (SPMD); rank 0 returns its tokens, shares and moments."""
    from lvx_app.engine.records import VideoRequest
    from lvx_app.engine.session import RankSession
    from lvx_app.parallel.group import init_distributed

    config = engine_config(checkpoint, None, dtype="float32", max_new_tokens=4, layout="striped")
    session = RankSession(config, init_distributed(cuda=False))
    session.load_video(VideoRequest.of(video, config.video))
    "".join(session.ask(EVIDENCE_QUESTION, config.generation))
    last = session.last_answer
    out = dict(tokens=list(last.tokens), new_tokens=last.new_tokens, evidence=last.evidence)
    return {**out, "shares": session.turns.last_shares} if rank == 0 else None


@pytest.mark.slow
def test_two_ranks_answer_with_the_evidence_one_process_computes(checkpoint, video):
    """Over 2 gloo ranks (striped frames), the answer's per-frame shares of the cross layers'
    attention equal a float64 softmax of the same queries in one process."""
    from test_evidence import _one_process_reference

    answer = run_ranks(_answers, 2, checkpoint, video)[0]
    assert answer["new_tokens"] >= 1 and answer["evidence"]
    want = _one_process_reference(checkpoint, video, answer)
    got = torch.tensor(answer["shares"], dtype=torch.float64)
    assert got.numel() == 6 and (got - want).abs().max() < 1e-6, (got, want)


@pytest.mark.slow
def test_open_over_two_ranks_answers_with_evidence(checkpoint, video):
    options = dict(gpus=0, ranks=2, cache=False, decode_workers=1, subtitles="none")
    with lvx.open(checkpoint, max_new_tokens=4, **options) as engine:
        assert engine.load_video(video, fps=1).frames == 6
        answer = "".join(engine.ask(QUESTION))
        last = engine.last_answer
        assert answer and 1 <= last.new_tokens <= 4
        assert last.evidence and all(0 <= m.start <= m.end <= 6 for m in last.evidence)
        assert "".join(engine.ask("and then?")) and engine.last_answer.evidence


@pytest.mark.slow
def test_lvx_chat_over_two_ranks_prints_where_it_looked(checkpoint, video):
    from test_evidence import _chat  # the chat test of the other families

    out = _chat(checkpoint, video, "--ranks", "2")
    answer_and_after = out.split("lvx › ", 1)[1].splitlines()
    assert answer_and_after[1].startswith("seen at 0:0") and "%)" in answer_and_after[1], out


@pytest.mark.slow
def test_demo_on_the_tiny_openflamingo_answers_with_its_moments(tmp_path):
    argv = ["demo", "--model-family", "openflamingo", "--ranks", "2", "--workdir", str(tmp_path)]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    said = result.output
    assert result.exit_code == 0, said
    assert "tiny random-weight OpenFlamingo (v2)" in said
    assert len(re.findall(r"^seen at \d+:\d\d.* \(\d+%\)", said, re.MULTILINE)) == 2, said
    assert family_of(tmp_path / "tiny-openflamingo-v2") is FAMILY


@pytest.mark.slow
def test_finetune_on_two_ranks_leaves_a_checkpoint_with_the_adapters_merged(
    checkpoint, short_video, tmp_path
):
    """Two CPU ranks finetune the LoRA adapters (the loss falls); the folder the run leaves loads
    as an OpenFlamingo checkpoint, the adapters merged into its weights. (A run killed and resumed
    equals the uninterrupted one: tests/test_mllama_train.py, the same training for every
    family.)"""
    from test_mllama_train import STATE_FILE, _args, _finetune

    part = tmp_path / "out"
    _finetune(_args(tmp_path, short_video, checkpoint, part, "--save-every", "0"))
    got = torch.load(part / STATE_FILE, weights_only=False)
    losses = [h["loss"] for h in got["history"]]
    assert losses[-1] < losses[0], losses
    model, _, _ = FAMILY.load(part)
    base, _, _ = FAMILY.load(checkpoint)
    key = "flamingo.lang_encoder.transformer.blocks.1.decoder_layer.attn.Wqkv"
    a, b = got["trainable"][f"{key}.lora_A"], got["trainable"][f"{key}.lora_B"]
    w = base.state_dict()[f"{key}.weight"]
    merged = w + (8 / 4) * (b.float() @ a.float())  # alpha 2R, stored float32 as the base
    torch.testing.assert_close(model.state_dict()[f"{key}.weight"], merged, rtol=1e-6, atol=1e-7)
    assert not torch.equal(model.state_dict()[f"{key}.weight"], w)


def _open_flamingo_save(reference) -> dict:
    """What open_flamingo's training saves of `reference` (the published `checkpoint.pt`): the
    factory's freezing (all but the perceiver, the cross layers and the input embeddings), then
    its `filter_state_dict_to_trainable`, imported with a stand-in for `wandb`."""
    import sys
    import types

    from test_openflamingo_parity import _bare_packages

    reference.requires_grad_(False)
    reference.perceiver.requires_grad_(True)
    reference.lang_encoder.gated_cross_attn_layers.requires_grad_(True)
    reference.lang_encoder.get_input_embeddings().requires_grad_(True)
    with _bare_packages("open_flamingo"):
        sys.modules["wandb"] = types.ModuleType("wandb")
        try:
            from open_flamingo.train.train_utils import filter_state_dict_to_trainable

            return filter_state_dict_to_trainable(reference, reference.state_dict())
        finally:
            sys.modules.pop("wandb")


def test_what_open_flamingo_saves_loads_to_its_logits(tmp_path, monkeypatch):
    """A folder of the three parts as a user downloads them, made from open_flamingo's own
    `Flamingo` (`checkpoint.pt` as its training saves it, open_clip's `visual.*`, MPT's own
    weights with their padded embeddings and `mpt` config.json, a GPT-NeoX-style tokenizer):
    the tiny checkpoint's `checkpoint.pt` has the same keys, and lvx loads the folder to the
    reference's logits."""
    import json

    import test_openflamingo_parity as parity
    from safetensors.torch import save_file

    from lvx_models.openflamingo import tiny
    from lvx_models.openflamingo.config import MptConfig, OpenFlamingoConfig, VisionConfig
    from lvx_models.openflamingo.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    tok = FlamingoTokenizer.from_pretrained(tmp_path)
    cfg = OpenFlamingoConfig(
        vision=VisionConfig(image_size=28, patch_size=14, width=32, layers=2, heads=4),
        text=MptConfig(d_model=32, n_heads=4, n_layers=4, vocab_size=len(tok), qk_ln=False),
        cross_attn_every_n_layers=2,
        media_token_id=tok.image_id,
        eoc_token_id=tok.eoc_id,
    )
    monkeypatch.setattr(parity, "MEDIA", tok.image_id)
    monkeypatch.setattr(parity, "EOC", tok.eoc_id)
    reference = parity.reference_flamingo(cfg)
    saved = _open_flamingo_save(reference)
    torch.save(saved, tmp_path / "checkpoint.pt")
    tiny_keys = torch.load(write_tiny_checkpoint(tmp_path / "tiny", form="9B") / "checkpoint.pt")
    shape = {re.sub(r"\.\d+\.", ".N.", k) for k in saved}
    # transformers' MPT lists its tied head, trainable with the embeddings; MPT's own code has none
    shape.remove("lang_encoder.lm_head.weight")
    assert shape == {re.sub(r"\.\d+\.", ".N.", k) for k in tiny_keys}
    visual = {"visual." + k: v for k, v in reference.vision_encoder.state_dict().items()}
    save_file(visual, str(tmp_path / "open_clip_model.safetensors"))
    (tmp_path / "open_clip_config.json").write_text(json.dumps(tiny._clip_config(cfg.vision)))
    lm = reference.lang_encoder.state_dict()
    mpt = {
        re.sub(r"^old_decoder_blocks\.", "transformer.blocks.", k): v
        for k, v in lm.items()
        if k.startswith(("old_decoder_blocks.", "transformer.norm_f."))
    }
    mpt["transformer.wte.weight"] = torch.randn(len(tok) + 11, 32)  # MPT's own, padded
    torch.save(mpt, tmp_path / "pytorch_model.bin")
    config = tiny._mpt_config(cfg.text, "9B", len(tok) + 11)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _, proc = FAMILY.load(tmp_path)
    ids = [tok.image_id, 5, 6, tok.image_id, 7, 8, tok.eoc_id, tok.image_id, 9, 10]
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    want = parity._reference_logits(reference, torch.tensor([ids]), pixels)
    starts = torch.tensor([i for i, t in enumerate(ids) if t == tok.image_id])
    visual = model.prepare_visual(model.encode_images(pixels), starts)
    with torch.no_grad():
        got = model(torch.tensor([ids]), cache=model.new_cache(), visual=visual)
    assert want.abs().max() > 0.1 and (got - want).abs().max() < 1e-5


@pytest.mark.slow
def test_the_openai_api_and_the_page_answer_about_a_video(checkpoint, video, tmp_path):
    """The OpenAI-compatible API and the browser page, as for the other families."""
    from test_mllama_frontends import test_the_openai_api_and_the_page_answer_about_a_video as run

    run(checkpoint, video, tmp_path)


def test_a_second_load_reads_the_features_and_the_prompt_back(checkpoint, video, tmp_path):
    """The caches keep OpenFlamingo's features (keyed by the tower and perceiver weights) and its
    prefilled prompt: a second engine reads both back and gives the same answer."""
    options = dict(gpus=0, ranks=1, cache_dir=str(tmp_path / "cache"), decode_workers=1,
                   subtitles="none", max_new_tokens=4)  # fmt: skip
    said = []
    for _ in range(2):
        with lvx.open(checkpoint, **options) as engine:
            summary = engine.load_video(video, fps=1)
            said.append((summary, "".join(engine.ask(QUESTION))))
    (first, answer), (again, repeated) = said
    assert not first.from_cache and again.from_cache and again.prompt_from_cache
    assert answer == repeated


@pytest.mark.slow
def test_eval_answers_every_question_with_evidence_over_two_ranks(
    checkpoint, tmp_path, monkeypatch
):
    """`lvx eval videomme` on the tiny checkpoint over 2 CPU ranks: every answerable question is
    answered, each with where it looked."""
    from test_eval_end_to_end import _records
    from videomme_fixtures import make_mini_videomme

    monkeypatch.setenv("LVX_CACHE_DIR", str(tmp_path / "cache"))
    mini = make_mini_videomme(tmp_path / "videomme")
    out = tmp_path / "results.jsonl"
    args = ["eval", "videomme", "--data", str(mini.root), "--model", checkpoint, "--gpus", "0",
            "--ranks", "2", "--out", str(out), "--max-new-tokens", "4"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = _records(out)
    answerable = [r for r in mini.rows if r["videoID"] not in mini.missing]
    assert sorted(r["question_id"] for r in records) == sorted(r["question_id"] for r in answerable)
    assert all(r["evidence"] for r in records)
