"""A checkpoint and a video built so that one frame is where every answer must look.

`plant_checkpoint` copies a tiny checkpoint and edits its weights so that the hyper layers' visual
keys of a red frame point along every query, while the keys of grey frames are about zero:
- the vision tower passes its patch embedding through (every used encoder layer's output
  projections zero, no position embedding), and that embedding's channel 0 is the patch's mean
  red minus blue: about 2 for a red patch, about 0 for a grey one;
- the projector writes that channel, scaled, on hidden dimension 0 and a constant on dimension 1,
  so after the hyper layer's RMS norm a red frame's features lie along dimension 0 and a grey
  frame's along dimension 1;
- each hyper layer's visual key (`v_kv_proj`, K half) reads dimension 0 only, into the head's
  lowest-frequency rotary dimension, and the layer's query (`q_proj`) is a constant bias on that
  same dimension of every head. That rotary pair turns by about 6e-6 rad per position, so the
  query and a red frame's key stay aligned wherever they sit.

Everything else keeps its random weights (the answers stay gibberish, the values of the visual
attention included). `make_planted_video` writes the grey index frames of
`lvx_app.video.synthetic`, those of one second red.
"""

from __future__ import annotations

import fractions
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lvx_app.video.synthetic import frame_image

FEATURE_GAIN = 50.0  # projector: red-minus-blue channel -> hidden dimension 0
FEATURE_FLOOR = 10.0  # projector: constant on hidden dimension 1 (a grey frame's direction)
KEY_GAIN = 2.0  # v_kv_proj: hidden dimension 0 -> the key's lowest-frequency rotary dimension
QUERY_BIAS = 2.0  # q_proj: the constant query on that dimension
HYPER = re.compile(r"language_model\.model\.layers\.(\d+)\.self_attn\.v_kv_proj\.weight")


def _head_dims(config: dict) -> tuple[int, int, int]:
    text = config.get("text_config", config)
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    return heads, kv_heads, text["hidden_size"] // heads


def _vision(w: dict[str, torch.Tensor]) -> None:
    """The tower's output is its patch embedding: channel 0 = mean(red - blue) over the patch."""
    patch = torch.zeros_like(w["vision_model.embeddings.patch_embedding.weight"], dtype=torch.float)
    pixels = patch.shape[-1] * patch.shape[-2]
    patch[0, 0], patch[0, 2] = 1.0 / pixels, -1.0 / pixels
    w["vision_model.embeddings.patch_embedding.weight"] = patch
    for key in list(w):
        zero = key.startswith("vision_model.embeddings.") and "patch_embedding.weight" not in key
        zero |= key.startswith("vision_model.encoder.") and (".out_proj." in key or ".fc2." in key)
        if zero:
            w[key] = torch.zeros_like(w[key])


def _projector(w: dict[str, torch.Tensor]) -> None:
    """Red-minus-blue on hidden dimension 0, a constant on dimension 1, nothing else."""
    first = "vision2text_model.0" if "vision2text_model.0.weight" in w else "vision2text_model"
    weight = torch.zeros_like(w[f"{first}.weight"], dtype=torch.float)
    bias = torch.zeros_like(w[f"{first}.bias"], dtype=torch.float)
    weight[0, 0], bias[1] = FEATURE_GAIN, FEATURE_FLOOR
    w[f"{first}.weight"], w[f"{first}.bias"] = weight, bias
    if "vision2text_model.2.weight" in w:  # G2: Linear-GELU-Linear, the second one the identity
        eye = torch.eye(*w["vision2text_model.2.weight"].shape)
        w["vision2text_model.2.weight"] = eye
        w["vision2text_model.2.bias"] = torch.zeros_like(eye[0])


def _hyper_layer(w: dict[str, torch.Tensor], layer: int, config: dict) -> None:
    """Queries: a constant on each head's last rotate-half dimension of the first half (the
    slowest rotary pair); visual keys: hidden dimension 0 on that dimension, the rest zero."""
    heads, kv_heads, hd = _head_dims(config)
    slow = hd // 2 - 1
    prefix = f"language_model.model.layers.{layer}.self_attn"
    q_weight = torch.zeros_like(w[f"{prefix}.q_proj.weight"], dtype=torch.float)
    q_bias = torch.zeros_like(w[f"{prefix}.q_proj.bias"], dtype=torch.float)
    q_bias.view(heads, hd)[:, slow] = QUERY_BIAS
    kv_weight = w[f"{prefix}.v_kv_proj.weight"].float().clone()
    kv_bias = w[f"{prefix}.v_kv_proj.bias"].float().clone()
    keys = kv_weight.view(kv_heads, 2, hd, -1)[:, 0]  # head-major (kv head, {K, V}, d)
    keys.zero_()
    keys[:, slow, 0] = KEY_GAIN
    kv_bias.view(kv_heads, 2, hd)[:, 0] = 0.0
    w[f"{prefix}.q_proj.weight"], w[f"{prefix}.q_proj.bias"] = q_weight, q_bias
    w[f"{prefix}.v_kv_proj.weight"], w[f"{prefix}.v_kv_proj.bias"] = kv_weight, kv_bias


def plant_checkpoint(source: str | Path, target: str | Path) -> Path:
    """A copy of the tiny checkpoint `source` in `target` whose visual attention finds red frames
    (module docstring). Returns `target`."""
    import json

    source, target = Path(source), Path(target)
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    file = target / "model.safetensors"
    w = load_file(str(file))
    dtype = next(iter(w.values())).dtype
    _vision(w)
    _projector(w)
    for key in list(w):
        match = HYPER.fullmatch(key)
        if match:
            _hyper_layer(w, int(match.group(1)), config)
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, str(file), {"format": "pt"})
    return target


RED = np.array([220, 20, 20], dtype=np.uint8)


def make_planted_video(
    path: str | Path, seconds: int, planted_second: int, fps: int = 2, size: int = 64
) -> Path:
    """`seconds` of grey index frames at `fps`, those of `planted_second` all red."""
    import av

    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps))
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(seconds * fps):
            image = frame_image(i, size, size)
            if i // fps == planted_second:
                image = np.broadcast_to(RED, image.shape).copy()
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
