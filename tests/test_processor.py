"""Processor: ChatML template, placeholders, media_starts / media_offset per generation, the prompt
rules of each release (video span, cut beside videos, cut prompt) and where they are read from, cut
logic, the one image transform (vs PIL bicubic), tokenizer streaming."""

import shutil

import numpy as np
import pytest
import torch

from lvx_models.mplug_owl3.chat_template import CUT_PROMPTS
from lvx_models.mplug_owl3.checkpoint import CheckpointError
from lvx_models.mplug_owl3.image_cut import GRID_SQU_6, select_cut_grid
from lvx_models.mplug_owl3.processor import Owl3Processor
from lvx_models.mplug_owl3.prompt_inputs import NO_MEDIA
from lvx_models.mplug_owl3.prompt_rules import (
    CUT_TEMPLATES,
    IMAGE_PROCESSING_FILE,
    PROCESSING_FILE,
    cut_beside_video_in,
    cut_template_in,
    published_rules,
    read_prompt_rules,
    video_span_in,
)
from lvx_models.mplug_owl3.tiny import processor_files, write_tiny_checkpoint
from lvx_models.pixels import _resize_two_pass, resize_uint8, to_pixel_values

PIL = pytest.importorskip("PIL.Image")

SYS = "<|im_start|>system\n<|im_end|>"
ASSISTANT = "\n<|im_start|>assistant\n"
FORMS = ("g1-gateproj", "g1", "g2")  # as published: 7B-240728, 1B/2B-241014, 7B-241101


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_proc")
    return {g: write_tiny_checkpoint(root / g, g) for g in FORMS}


@pytest.fixture(scope="module")
def procs(ckpts):
    return {g: Owl3Processor.from_pretrained(d) for g, d in ckpts.items()}


def rand_img(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def enc(p, *chunks):
    return [i for c in chunks for i in p.encode(c)]


# ---- template
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", ["g1", "g2"])
def test_text_only_prompt_is_chatml_with_empty_system(procs, g):
    p = procs[g]
    pi = p.build_chat_prompt([{"role": "user", "content": "Hi there"}])
    assert pi.text == f"{SYS}\n<|im_start|>user\nHi there<|im_end|>{ASSISTANT}"
    assert pi.input_ids.tolist() == enc(p, SYS, "\n<|im_start|>user\nHi there<|im_end|>", ASSISTANT)
    assert pi.input_ids.dtype == torch.int64 and pi.media_starts == [] and pi.pixel_values is None
    mo = p.media_offset(pi)
    if g == "g1":
        assert (
            mo.shape == (1, len(pi.input_ids), 2)
            and (mo[..., 0] == 0).all()
            and (mo[..., 1] == NO_MEDIA).all()
        )
    else:
        assert len(mo) == 1 and mo[0].numel() == 0


def test_system_message_replaces_empty_system_and_history_has_eod(procs):
    p = procs["g2"]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": ""},
    ]
    pi = p.build_chat_prompt(msgs)
    chunks = [
        "<|im_start|>system\nBe brief.<|im_end|>",
        "\n<|im_start|>user\na<|im_end|>",
        ASSISTANT,
        "b<|im_end|>",
        "<|endoftext|>",
        "\n<|im_start|>user\nc<|im_end|>",
        ASSISTANT,
    ]
    assert pi.text == "".join(chunks)
    assert pi.input_ids.tolist() == enc(p, *chunks)
    # a final assistant message with content starts the answer
    assert p.build_chat_prompt(
        msgs[:-1] + [{"role": "assistant", "content": "Answer: ("}]
    ).text.endswith(f"{ASSISTANT}Answer: (")


def test_placeholder_is_its_own_chunk(procs):
    p = procs["g2"]
    img_ids = p.encode("<|image|>")
    assert len(img_ids) > 1  # plain text, several BPE tokens; never assumed to be a number
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "x<|image|>y"}], images=[rand_img(30, 30)], cut=False
    )
    ids = pi.input_ids.tolist()
    (s,) = pi.media_starts
    assert ids[s : s + len(img_ids)] == img_ids and pi.placeholder_len == len(img_ids)
    assert ids == enc(p, SYS, "\n<|im_start|>user\nx", "<|image|>", "y<|im_end|>", ASSISTANT)


# ---- video
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", FORMS)
def test_video_placeholders_and_media_offset(procs, g):
    p = procs[g]
    frames = np.stack([rand_img(24, 40, s) for s in range(5)])
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "<|video|>\nWhat happens?"}], videos=[frames]
    )
    body = "<|image|>" * 5
    if g != "g1-gateproj":
        body = f"<|start_video_frame|>{body}<|end_video_frame|>"
    assert pi.text == f"{SYS}\n<|im_start|>user\n{body}\nWhat happens?<|im_end|>{ASSISTANT}"
    ids = pi.input_ids.tolist()
    assert len(pi.media_starts) == 5 == pi.num_placeholders
    for s in pi.media_starts:
        assert p.decode(ids[s : s + pi.placeholder_len], skip_special_tokens=False) == "<|image|>"
    assert torch.equal(pi.pixel_values, to_pixel_values(frames, p.image_size))
    assert pi.pixel_values.shape == (5, 3, p.image_size, p.image_size)
    mo = p.media_offset(pi)
    if p.generation == "g2":
        assert mo[0].tolist() == pi.media_starts
    else:  # [0, #{j : t > start_j}]
        want = [sum(t > s for s in pi.media_starts) for t in range(len(ids))]
        assert (
            mo.shape == (1, len(ids), 2)
            and mo[0, :, 1].tolist() == want
            and (mo[0, :, 0] == 0).all()
        )


def test_video_as_frame_count_gives_placeholders_only(procs):
    p = procs["g2"]
    pi = p.build_chat_prompt([{"role": "user", "content": "<|video|>Q"}], videos=[7])
    assert pi.num_placeholders == 7 and pi.pixel_values is None and pi.media[0].pixel_values is None
    frames = np.zeros((7, 10, 10, 3), np.uint8)
    assert (
        pi.input_ids.tolist()
        == p.build_chat_prompt(
            [{"role": "user", "content": "<|video|>Q"}], videos=[frames]
        ).input_ids.tolist()
    )


def test_followup_continues_the_conversation_exactly(procs):
    p = procs["g2"]
    first = p.build_chat_prompt([{"role": "user", "content": "<|video|>Q1"}], videos=[3])
    answer = p.encode("The dog runs.") + [p.tokenizer.im_end_id]  # what generation produced
    offset = len(first.input_ids) + len(answer)
    nxt = p.build_followup("Q2 <|image|>", offset=offset, images=[rand_img(20, 20)], cut=False)
    whole = p.build_chat_prompt(
        [
            {"role": "user", "content": "<|video|>Q1"},
            {"role": "assistant", "content": "The dog runs."},
            {"role": "user", "content": "Q2 <|image|>"},
        ],
        videos=[3],
        images=[rand_img(20, 20)],
        cut=False,
    )
    assert first.input_ids.tolist() + answer + nxt.input_ids.tolist() == whole.input_ids.tolist()
    assert first.media_starts + nxt.media_starts == whole.media_starts
    with pytest.raises(ValueError):
        p.media_offset(nxt)


# ---- still images and cutting
# --------------------------------------------------------------------------------------------------
def test_cut_grid_rule():
    s = 378
    for r, c in GRID_SQU_6:  # an image with an anchor's exact aspect picks that anchor
        assert select_cut_grid(r * 100, c * 100, s) == (r, c)
    assert select_cut_grid(480, 640, s) == (2, 3)
    assert select_cut_grid(1080, 1920, s) == (2, 3)  # 16:9 is closer in shape to 3:2 than to 3:1
    assert select_cut_grid(100, 1000, s) == (1, 4) and select_cut_grid(1000, 100, s) == (4, 1)


@pytest.mark.parametrize("g", FORMS)
def test_cut_image_prompt_and_pixels(procs, g):
    p = procs[g]
    S = p.image_size
    img = rand_img(40, 90)  # wide: 1 x 3
    pi = p.build_chat_prompt([{"role": "user", "content": "<|image|>Describe."}], images=[img])
    (item,) = pi.media
    assert item.cut == (1, 3) == select_cut_grid(40, 90, S) and item.num_placeholders == 4
    if g == "g1-gateproj":  # 240728: v2_global
        cut = (
            "Cut to 1 rows 3 columns with a global view\nsubimg(0,0)<|image|> subimg(0,1)<|image|> "
            "subimg(0,2)<|image|>\nglobal_view<|image|>"
        )
    else:  # 241014 and 241101: v3_global
        cut = "<|start_cut|>1*3\n<|image|> <|image|> <|image|>\n<|image|><|end_cut|>"
    assert pi.text == f"{SYS}\n<|im_start|>user\n{cut}Describe.<|im_end|>{ASSISTANT}"
    assert pi.num_placeholders == 4
    wide = (resize_uint8(img, S, 3 * S).float() / 255 - 0.5) / 0.5
    for k in range(3):
        assert torch.equal(pi.pixel_values[k], wide[0, :, :, k * S : (k + 1) * S])
    assert torch.equal(pi.pixel_values[3], to_pixel_values(img, S)[0])  # global view last


def test_each_image_uses_its_own_grid(procs):
    p = procs["g1-gateproj"]  # the 240728 processor reads the wrong grid after the first image
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "<|image|><|image|>"}],
        images=[rand_img(40, 90), rand_img(90, 40)],
    )
    assert [m.cut for m in pi.media] == [(1, 3), (3, 1)]
    assert "Cut to 1 rows 3 columns" in pi.text and "Cut to 3 rows 1 columns" in pi.text
    assert pi.num_placeholders == 8 and pi.pixel_values.shape[0] == 8


# ---- the prompt rules of each release
# --------------------------------------------------------------------------------------------------
def video_ids(p, span: bool, question: str = "What happens?") -> tuple[str, list[int], list[int]]:
    """(text, ids, media_starts) of a 3-frame video prompt, built here chunk by chunk."""
    head = "\n<|im_start|>user\n" + ("<|start_video_frame|>" if span else "")
    tail = ("<|end_video_frame|>" if span else "") + f"\n{question}<|im_end|>"
    ids, starts = enc(p, SYS, head), []
    for _ in range(3):
        starts.append(len(ids))
        ids += enc(p, "<|image|>")
    ids += enc(p, tail, ASSISTANT)
    return f"{SYS}{head}{'<|image|>' * 3}{tail}{ASSISTANT}", ids, starts


@pytest.mark.parametrize("g, span", [("g1-gateproj", False), ("g1", True), ("g2", True)])
def test_three_frame_video_prompt_per_release(procs, g, span):
    p = procs[g]
    pi = p.build_chat_prompt([{"role": "user", "content": "<|video|>\nWhat happens?"}], videos=[3])
    text, ids, starts = video_ids(p, span)
    assert pi.text == text and pi.input_ids.tolist() == ids and pi.media_starts == starts
    if span:
        assert "<|start_video_frame|><|image|><|image|><|image|><|end_video_frame|>" in pi.text
    else:
        assert "<|start_video_frame|>" not in pi.text and "<|image|>" * 3 + "\n" in pi.text


@pytest.mark.parametrize("g, cut", [("g1-gateproj", False), ("g1", True), ("g2", True)])
def test_image_beside_a_video_is_cut_as_the_release_did(procs, g, cut):
    p = procs[g]
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "<|video|><|image|>"}], videos=[2], images=[rand_img(40, 90)]
    )
    assert pi.media[1].cut == ((1, 3) if cut else None)
    assert pi.num_placeholders == 2 + (4 if cut else 1)
    alone = p.build_chat_prompt(
        [{"role": "user", "content": "<|image|>"}], images=[rand_img(40, 90)]
    )
    assert alone.media[0].cut == (1, 3), "without a video every release cuts"
    asked = p.build_chat_prompt(
        [{"role": "user", "content": "<|video|><|image|>"}],
        videos=[2],
        images=[rand_img(40, 90)],
        cut=False,
    )
    assert asked.media[1].cut is None, "cut=False is always obeyed"


def test_processor_files_win_over_the_published_default(ckpts, tmp_path):
    d = tmp_path / "g1"
    shutil.copytree(ckpts["g1"], d)
    assert Owl3Processor.from_pretrained(d).rules == published_rules("g1")
    for name, text in processor_files(published_rules("g1-gateproj")).items():
        (d / name).write_text(text)  # a 241014-form checkpoint whose files state 240728's rules
    p = Owl3Processor.from_pretrained(d)
    assert (p.rules.video_span, p.rules.cut_beside_video, p.cut_template) == (
        False,
        False,
        "v2_global",
    )
    assert p.rules.sources["video_span"] == PROCESSING_FILE
    assert p.rules.sources["cut_template"] == IMAGE_PROCESSING_FILE
    pi = p.build_chat_prompt([{"role": "user", "content": "<|video|>\nWhat happens?"}], videos=[3])
    assert pi.input_ids.tolist() == video_ids(p, span=False)[1]
    (d / PROCESSING_FILE).unlink()
    (d / IMAGE_PROCESSING_FILE).unlink()
    bare = read_prompt_rules(d, "g1")
    assert bare == published_rules("g1")
    assert set(bare.sources.values()) == {"published default of 1B/2B-241014"}


def test_processor_text_is_read_as_the_official_files_state_it():
    # the 240728 form: cut off by a statement when videos are present, frames written bare
    old = (
        "    if videos:\n        cut_enable = False  # no cut with videos\n"
        "        text = content.split('<|video|>')\n"
        "    out = self.image_processor(images, cut_enable=cut_enable)\n"
    )
    assert video_span_in(old) is False and cut_beside_video_in(old) is False
    # the 241014 / 241101 form: every video entry marks the span; each image gets the call's cut
    new = (
        "    media = [{'type': 'video', 'content': v, 'use_video_span': True} for v in videos]\n"
        "    out = self.image_processor([image], cut_enable=cut_enable)\n"
        "    frames = self.image_processor(video,\n        cut_enable=False)['pixel_values']\n"
    )
    assert video_span_in(new) is True and cut_beside_video_in(new) is True
    silent = "def helper():\n    return 1\n"
    assert video_span_in(silent) is None and cut_beside_video_in(silent) is None
    cfg = '{"anchors": "grid_squ_6", "cut_prompt": "%s", "add_global": %s}'
    assert cut_template_in(cfg % ("v2", "True")) == "v2_global"
    assert cut_template_in(cfg % ("v3", "True")) == "v3_global"
    assert cut_template_in(silent) is None
    with pytest.raises(CheckpointError, match="only v2_global, v3_global"):
        cut_template_in(cfg % ("v3", "False"))
    with pytest.raises(CheckpointError, match="anchors 'grid_33'"):
        cut_template_in(cfg.replace("grid_squ_6", "grid_33") % ("v3", "True"))
    assert set(CUT_PROMPTS) == set(CUT_TEMPLATES)


def test_media_count_errors(procs):
    p = procs["g2"]
    with pytest.raises(ValueError, match="more <\\|image\\|> markers"):
        p.build_chat_prompt([{"role": "user", "content": "<|image|>"}])
    with pytest.raises(ValueError, match="without a matching"):
        p.build_chat_prompt([{"role": "user", "content": "hi"}], videos=[3])
    with pytest.raises(ValueError, match="only allowed in user"):
        p.build_chat_prompt([{"role": "system", "content": "<|image|>"}], images=[rand_img(5, 5)])


# ---- the image transform vs PIL
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw,size", [((120, 200), 28), ((480, 640), 378), ((60, 50), 100)])
def test_transform_matches_pil_bicubic(hw, size):
    frames = np.stack([rand_img(*hw, s) for s in range(2)])
    ref = np.stack([np.asarray(PIL.fromarray(f).resize((size, size), PIL.BICUBIC)) for f in frames])
    ref = torch.from_numpy(ref).permute(0, 3, 1, 2).float()
    got = to_pixel_values(frames, size)
    assert got.dtype == torch.float32 and got.shape == (2, 3, size, size)
    levels = (got * 127.5 + 127.5 - ref).abs()  # in uint8 levels
    assert levels.max() <= 2.01 and levels.mean() < 0.05
    assert torch.allclose(got, (ref / 255 - 0.5) / 0.5, atol=2 / 127.5 + 1e-6)
    # the float path used on GPUs (two passes, rounded in between like PIL)
    two = _resize_two_pass(torch.from_numpy(frames).permute(0, 3, 1, 2), size, size).float()
    assert (two - ref).abs().max() <= 2 and (two - ref).abs().mean() < 0.05


def test_transform_inputs():
    img = rand_img(20, 30)
    a = to_pixel_values(img, 14)
    assert a.shape == (1, 3, 14, 14)
    assert torch.equal(a, to_pixel_values(PIL.fromarray(img), 14))
    assert torch.equal(a, to_pixel_values(torch.from_numpy(img)[None], 14))
    assert torch.equal(
        to_pixel_values(rand_img(14, 14), 14),
        (torch.from_numpy(rand_img(14, 14)).permute(2, 0, 1)[None].float() / 255 - 0.5) / 0.5,
    )
    with pytest.raises(ValueError):
        to_pixel_values(np.zeros((4, 4, 3), np.float32), 14)


# ---- tokenizer
# --------------------------------------------------------------------------------------------------
def test_stream_decoder_never_splits_characters(procs):
    p = procs["g2"]
    text = "Ein Hund läuft → 中文 ☃😀 über die Straße."
    ids = p.encode(text) + [p.tokenizer.im_end_id]
    s = p.stream()
    pieces = [s.push(i) for i in ids]
    pieces.append(s.flush())
    assert "".join(pieces) == text and not any("\ufffd" in x for x in pieces)
    assert sum(1 for x in pieces if x) > 3  # it streams, not all at the end


def test_stop_ids_and_answer_decoding(procs):
    t = procs["g1"].tokenizer
    assert procs["g1"].stop_ids == (t.im_end_id, t.endoftext_id)
    assert t.decode_answer(t.encode("  yes  ") + [t.im_end_id]) == "yes"
