"""mPLUG-Owl3 in plain PyTorch: config, SigLIP tower, projector, Qwen2 with hyper-attention (no
torch.distributed)."""

from ..steps import AttentionHooks, LazyVisualKV, TextKVCache, VisualInputs
from .config import TRAINED_POSITIONS, Owl3Config, SiglipVisionConfig
from .hyper import frame_rope_positions, visible_frames
from .modeling import Owl3Model

__all__ = [
    "TRAINED_POSITIONS",
    "AttentionHooks",
    "LazyVisualKV",
    "Owl3Config",
    "Owl3Model",
    "SiglipVisionConfig",
    "TextKVCache",
    "VisualInputs",
    "frame_rope_positions",
    "visible_frames",
]
