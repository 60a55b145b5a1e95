"""Our Llama-3.2-Vision equals transformers' `MllamaForConditionalGeneration` on tiny random
checkpoints in the published layout (logits in float32, greedy tokens), and our processor's ids,
pixels, aspect ratios and cross-attention mask equal `MllamaProcessor`'s. A video through
`lvx.open` (frames of one tile, which the tower runs beside the published empty tiles) gets
transformers' greedy answer on 1, 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lvx_models.api import family_of
from lvx_models.mllama.loader import load_mllama
from lvx_models.mllama.processor import chat_prompt
from lvx_models.mllama.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-5


@pytest.fixture(scope="module", params=[4, 1], ids=["4-tiles", "1-tile"])
def pair(request, tmp_path_factory):
    """(lvx's model and processor, transformers' model and processor) of one tiny checkpoint."""
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("mllama"), max_tiles=request.param)
    ours = load_mllama(d, torch.float32)
    hf, info = transformers.MllamaForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    hf_proc = transformers.MllamaProcessor.from_pretrained(d)
    return ours, hf.eval(), hf_proc


def _images(seed: int, sizes) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


PROMPTS = {
    "one image": lambda: (chat_prompt("what is the dog doing", 1), _images(0, [(40, 70)])),
    "video": lambda: (
        chat_prompt("what happens first in the video", 3),
        _images(1, [(30, 50), (30, 50), (30, 50)]),
    ),
    "images between text": lambda: (
        chat_prompt("the first <|image|>and the second picture", 1),
        _images(2, [(60, 25), (28, 28)]),
    ),
}


def _compare_inputs(ours, theirs) -> None:
    assert torch.equal(ours.input_ids, theirs["input_ids"])
    for name in ("aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"):
        assert torch.equal(getattr(ours, name), theirs[name].to(torch.int64)), name
    torch.testing.assert_close(ours.pixel_values, theirs["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_logits_and_greedy_tokens_match_transformers(pair, prompt):
    (model, processor, _), hf, hf_proc = pair
    text, images = PROMPTS[prompt]()
    ours = processor(text, images)
    theirs = hf_proc(text=text, images=[images], add_special_tokens=False, return_tensors="pt")
    _compare_inputs(ours, theirs)
    with torch.no_grad():
        logits = model(ours.input_ids, **ours.model_inputs())
        ref = hf(**theirs).logits
    diff = (logits - ref).abs().max().item()
    assert diff < LOGIT_TOL, f"max |logit diff| {diff:.2e}"
    out = hf.generate(**theirs, max_new_tokens=6, do_sample=False)
    assert (
        model.greedy(ours.input_ids, 6, **ours.model_inputs())
        == out[0, ours.input_ids.shape[1] :].tolist()
    )


def _lossless_video(path, frames: np.ndarray) -> str:
    """An mp4 at 1 fps whose decoded frames are `frames` (N, H, W, 3) exactly (RGB H.264, qp 0)."""
    import fractions

    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264rgb", rate=fractions.Fraction(1))
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "rgb24"
        s.options = {"qp": "0", "preset": "veryfast"}
        for f in frames:
            for packet in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return str(path)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny checkpoint of up to 4 tiles (gates open), frames of exactly one tile, and the
    published processor's inputs for them in the published chat template."""
    # a seed whose greedy answer the empty tiles change from its first token
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("published"), seed=5)
    size = 28  # the tiny tile: a frame is one tile, never resized
    frames = np.random.default_rng(0).integers(0, 256, (3, size, size, 3), dtype=np.uint8)
    hf_proc = transformers.MllamaProcessor.from_pretrained(d)
    # lvx's first turn: the video, a line break, the question
    turn = [{"type": "image"}] * len(frames) + [{"type": "text", "text": "\n" + VIDEO_QUESTION}]
    messages = [{"role": "user", "content": turn}]
    text = hf_proc.apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_proc(
        text=text, images=[list(frames)], add_special_tokens=False, return_tensors="pt"
    )
    assert theirs["pixel_values"].shape[2] == 4  # each frame's tile and 3 empty ones
    assert theirs["aspect_ratio_mask"][0, :, 1:].sum() == 0
    return d, frames, theirs


VIDEO_QUESTION = "what happens first in the video"


def test_frame_features_are_the_published_towers(published):
    """A frame the engine prepares and encodes gives the visual tokens transformers' tower and
    projector give its tile when the published processor hands them the frame with its empty
    tiles."""
    d, frames, theirs = published
    loaded = family_of(d).load(d, dtype=torch.float32)
    hf = transformers.MllamaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    pixels = loaded.processor.frame_prep.pixel_values(frames)
    with torch.no_grad():
        ours = loaded.model.encode_images(pixels)
        out = hf.model.vision_model(
            pixel_values=theirs["pixel_values"],
            aspect_ratio_ids=theirs["aspect_ratio_ids"],
            aspect_ratio_mask=theirs["aspect_ratio_mask"],
        ).last_hidden_state
        want = hf.model.multi_modal_projector(out)[0, :, 0]  # each frame's own tile
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def reference_tokens(published):
    """transformers' greedy answer to the video question, as published."""
    d, _, theirs = published
    hf = transformers.MllamaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    out = hf.generate(**theirs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, theirs["input_ids"].shape[1] :].tolist()


NEW_TOKENS = 12


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_open_answers_a_video_as_transformers_does(published, reference_tokens, tmp_path, ranks):
    """`lvx.open` on 1, 2 and 3 gloo ranks answers a video question with transformers' greedy
    tokens on the published checkpoint, processor and chat template (frames of one tile, padded
    with empty tiles in the tower)."""
    import lvx_app as lvx

    d, frames, _ = published
    video = _lossless_video(tmp_path / "frames.mp4", frames)
    options = dict(gpus=0, ranks=ranks, cache=False, decode_workers=1, subtitles="none")
    with lvx.open(str(d), dtype="float32", max_new_tokens=NEW_TOKENS, **options) as engine:
        assert engine.load_video(video, fps=1).frames == len(frames)
        "".join(engine.ask(VIDEO_QUESTION))
        assert engine.last_answer.tokens == reference_tokens


@pytest.mark.slow
def test_a_cached_video_answers_as_a_fresh_one(published, reference_tokens, tmp_path, monkeypatch):
    """With the caches on: a reopened video (features and prompt read back) answers as
    transformers does; a prompt that differs after the frames reads the saved header back, and one
    whose header differs (text before the video) encodes the frames again for it; each answers as
    the same load without the caches."""
    import lvx_app as lvx
    from lvx_app.engine.records import VideoOpening
    from lvx_app.engine.video_context import VideoContext
    from lvx_app.subtitles import Cue

    d, frames, _ = published
    video = _lossless_video(tmp_path / "frames.mp4", frames)
    options = dict(gpus=0, ranks=1, decode_workers=1, subtitles="none")
    cues = dict(subtitles=[Cue(0.0, 1.5, "a dog runs")])
    before = dict(opening=VideoOpening(before="Watch this."))
    encodes = []  # each ingest's cache option: off for the frames encoded again
    ingest = VideoContext._ingest

    def noted(self, path, video, *rest):
        encodes.append(video.cache)
        return ingest(self, path, video, *rest)

    monkeypatch.setattr(VideoContext, "_ingest", noted)

    with lvx.open(
        str(d), dtype="float32", max_new_tokens=NEW_TOKENS, cache=True,
        cache_dir=str(tmp_path / "cache"), **options,
    ) as engine:  # fmt: skip
        got = []
        for load in ({}, {}, cues, before):
            summary = engine.load_video(video, fps=1, **load)
            "".join(engine.ask(VIDEO_QUESTION))
            got.append((summary.from_cache, summary.prompt_from_cache, engine.last_answer.tokens))
    with lvx.open(str(d), dtype="float32", max_new_tokens=NEW_TOKENS, cache=False, **options) as e:
        fresh = []
        for load in (cues, before):
            e.load_video(video, fps=1, **load)
            "".join(e.ask(VIDEO_QUESTION))
            fresh.append(e.last_answer.tokens)
    assert got[0] == (False, False, reference_tokens)
    assert got[1] == (True, True, reference_tokens)
    assert got[2] == (True, False, fresh[0])
    assert got[3] == (True, False, fresh[1])
    assert encodes == [True] * 4 + [False] + [False] * 2  # the new header's frames again


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_text_chat_between_does_not_change_the_answer(
    published, reference_tokens, tmp_path, ranks
):
    """A chat without the video shares the prompt's first tokens, not their K/V: the same question
    as a chat with the video after it and asked after a reset (the prompt fed again, the header's
    K/V the load made put back) get transformers' answer, and the text chat its own."""
    import lvx_app as lvx
    from lvx_models.api import VIDEO

    d, frames, _ = published
    video = _lossless_video(tmp_path / "frames.mp4", frames)
    options = dict(gpus=0, ranks=ranks, cache=False, decode_workers=1, subtitles="none")
    text_only = [{"role": "user", "content": "hello"}]
    with_video = [{"role": "user", "content": VIDEO + VIDEO_QUESTION}]
    with lvx.open(str(d), dtype="float32", max_new_tokens=NEW_TOKENS, **options) as engine:
        engine.load_video(video, fps=1)
        engine.reset(keep_prompt=False)  # the text chat's header is fed first, without the video
        got = []
        for turns in (text_only, with_video, text_only):
            "".join(engine.chat(turns))
            got.append(engine.last_answer.tokens)
        engine.reset()
        "".join(engine.ask(VIDEO_QUESTION))
        got.append(engine.last_answer.tokens)
    assert got[1] == got[3] == reference_tokens
    assert got[0] == got[2]  # nor does the text chat read the header's K/V made with the video


GRADS = (
    "multi_modal_projector.weight",
    "language_model.model.layers.1.cross_attn.k_proj.weight",
    "language_model.model.layers.1.cross_attn_attn_gate",
    "language_model.model.layers.0.self_attn.q_proj.weight",
    "vision_model.patch_embedding.weight",
    "vision_model.global_transformer.layers.0.gate_attn",
)


def test_gradients_match_transformers(pair):
    """The same loss gives the same weight gradients (vision tower, projector, cross and self
    layers): what finetuning needs of the model."""
    (model, processor, _), hf, hf_proc = pair
    text, images = PROMPTS["images between text"]()
    ours = processor(text, images)
    theirs = hf_proc(text=text, images=[images], add_special_tokens=False, return_tensors="pt")
    model.zero_grad()
    hf.zero_grad()
    model(ours.input_ids, **ours.model_inputs()).logsumexp(-1).sum().backward()
    hf(**theirs).logits.logsumexp(-1).sum().backward()
    theirs_params = dict(hf.named_parameters())
    for name in GRADS:  # transformers' names on load (it writes the published ones back)
        hf_name = "model." + name.replace("language_model.model.", "language_model.")
        got = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(got, theirs_params[hf_name].grad, rtol=1e-4, atol=1e-5)
