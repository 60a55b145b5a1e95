"""Cutting a still image as the official processors do (reference mplug_owl3.md §5.3): the best
`grid_squ_6` anchor by the "docowl" ranking, rows*cols crops row-major, then a global view."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..pixels import _as_uint8_nhwc, normalize, resize_uint8

# (rows, cols) anchors of the official "grid_squ_6" set; there is no 1x1
GRID_SQU_6 = ((2, 2), (1, 3), (1, 4), (3, 1), (4, 1), (2, 3), (3, 2))


def select_cut_grid(
    height: int, width: int, image_size: int, anchors: Sequence[tuple[int, int]] = GRID_SQU_6
) -> tuple[int, int]:
    """(rows, cols) chosen by the official 'docowl' rule: argmax of 100 * shape_IoU + IoU.

    Computed with the official tensor dtypes (int64 boxes, the rescaled anchor height truncated to
    an integer, float32 IoU), so ties and near-ties resolve exactly as there.
    """
    s = image_size
    boxes = torch.tensor([[0, 0, c * s, r * s] for r, c in anchors])  # xyxy, int64
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    shaped = boxes.clone()
    # aspect-matched anchor, truncated
    shaped[:, 3] = (height / width * boxes[:, 2].float()).to(torch.int64)

    def iou(b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        area2 = (b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])
        lt = torch.max(b1[:, None, :2], b2[:, :2])
        rb = torch.min(b1[:, None, 2:], b2[:, 2:])
        wh = (rb - lt).clamp(min=0)
        inter = wh[:, :, 0] * wh[:, :, 1]
        return inter / (areas[:, None] + area2 - inter + 1e-5)

    image_iou = iou(boxes, torch.tensor([[0, 0, width, height]])).squeeze(1)
    shape_iou = iou(boxes, shaped).diag()
    return anchors[int(torch.argmax(shape_iou * 100 + image_iou))]


def cut_image(
    image: Any, image_size: int, cut: bool = True
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """(pixel_values (n, 3, S, S), (rows, cols) or None) of one image. Cut: rows*cols crops
    row-major, then the global view; else the global view alone."""
    x = _as_uint8_nhwc(image)
    if x.shape[0] != 1:
        raise ValueError(
            f"one image expected, got a batch of {x.shape[0]} (pass video frames as videos=)"
        )
    s = image_size
    global_view = normalize(resize_uint8(x, s, s))
    if not cut:
        return global_view, None
    rows, cols = select_cut_grid(x.shape[1], x.shape[2], s)
    big = normalize(resize_uint8(x, rows * s, cols * s))[0]  # (3, rows*S, cols*S)
    crops = big.view(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, s, s)
    return torch.cat([crops, global_view]), (rows, cols)
