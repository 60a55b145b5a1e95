"""Processor: ChatML template, placeholders, media_starts / media_offset per generation, cut logic,
the one image
transform (vs PIL bicubic), tokenizer streaming."""

import numpy as np
import pytest
import torch

from lvx_models.mplug_owl3.image_transform import _resize_two_pass, resize_uint8, to_pixel_values
from lvx_models.mplug_owl3.processor import GRID_SQU_6, NO_MEDIA, Owl3Processor, select_cut_grid
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

PIL = pytest.importorskip("PIL.Image")

SYS = "<|im_start|>system\n<|im_end|>"
ASSISTANT = "\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_proc")
    return {
        g: Owl3Processor.from_pretrained(write_tiny_checkpoint(root / g, g)) for g in ("g1", "g2")
    }


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
    mo = pi.media_offset()
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
@pytest.mark.parametrize("g", ["g1", "g2"])
def test_video_placeholders_and_media_offset(procs, g):
    p = procs[g]
    frames = np.stack([rand_img(24, 40, s) for s in range(5)])
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "<|video|>\nWhat happens?"}], videos=[frames]
    )
    body = "<|image|>" * 5
    if g == "g2":
        body = f"<|start_video_frame|>{body}<|end_video_frame|>"
    assert pi.text == f"{SYS}\n<|im_start|>user\n{body}\nWhat happens?<|im_end|>{ASSISTANT}"
    ids = pi.input_ids.tolist()
    assert len(pi.media_starts) == 5 == pi.num_placeholders
    for s in pi.media_starts:
        assert p.decode(ids[s : s + pi.placeholder_len], skip_special_tokens=False) == "<|image|>"
    assert torch.equal(pi.pixel_values, to_pixel_values(frames, p.image_size))
    assert pi.pixel_values.shape == (5, 3, p.image_size, p.image_size)
    mo = pi.media_offset()
    if g == "g2":
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
        nxt.media_offset()


# ---- still images and cutting
# --------------------------------------------------------------------------------------------------
def test_cut_grid_rule():
    s = 378
    for r, c in GRID_SQU_6:  # an image with an anchor's exact aspect picks that anchor
        assert select_cut_grid(r * 100, c * 100, s) == (r, c)
    assert select_cut_grid(480, 640, s) == (2, 3)
    assert select_cut_grid(1080, 1920, s) == (2, 3)  # 16:9 is closer in shape to 3:2 than to 3:1
    assert select_cut_grid(100, 1000, s) == (1, 4) and select_cut_grid(1000, 100, s) == (4, 1)


@pytest.mark.parametrize("g", ["g1", "g2"])
def test_cut_image_prompt_and_pixels(procs, g):
    p = procs[g]
    S = p.image_size
    img = rand_img(40, 90)  # wide: 1 x 3
    pi = p.build_chat_prompt([{"role": "user", "content": "<|image|>Describe."}], images=[img])
    (item,) = pi.media
    assert item.cut == (1, 3) == select_cut_grid(40, 90, S) and item.num_placeholders == 4
    if g == "g1":
        cut = (
            "Cut to 1 rows 3 columns with a global view\nsubimg(0,0)<|image|> subimg(0,1)<|image|> "
            "subimg(0,2)<|image|>\nglobal_view<|image|>"
        )
    else:
        cut = "<|start_cut|>1*3\n<|image|> <|image|> <|image|>\n<|image|><|end_cut|>"
    assert pi.text == f"{SYS}\n<|im_start|>user\n{cut}Describe.<|im_end|>{ASSISTANT}"
    assert pi.num_placeholders == 4
    wide = (resize_uint8(img, S, 3 * S).float() / 255 - 0.5) / 0.5
    for k in range(3):
        assert torch.equal(pi.pixel_values[k], wide[0, :, :, k * S : (k + 1) * S])
    assert torch.equal(pi.pixel_values[3], to_pixel_values(img, S)[0])  # global view last


def test_each_image_uses_its_own_grid(procs):
    p = procs["g1"]  # the 240728 processor reads the wrong grid after the first image; we do not
    pi = p.build_chat_prompt(
        [{"role": "user", "content": "<|image|><|image|>"}],
        images=[rand_img(40, 90), rand_img(90, 40)],
    )
    assert [m.cut for m in pi.media] == [(1, 3), (3, 1)]
    assert "Cut to 1 rows 3 columns" in pi.text and "Cut to 3 rows 1 columns" in pi.text
    assert pi.num_placeholders == 8 and pi.pixel_values.shape[0] == 8


def test_g1_videos_disable_cut_like_official(procs):
    pi = procs["g1"].build_chat_prompt(
        [{"role": "user", "content": "<|video|><|image|>"}], videos=[2], images=[rand_img(40, 90)]
    )
    assert pi.media[1].cut is None and pi.num_placeholders == 3


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
