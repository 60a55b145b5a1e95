"""mPLUG-Owl3 in plain PyTorch: config, SigLIP tower, projector, Qwen2 with hyper-attention (no
torch.distributed)."""

from .config import TRAINED_POSITIONS, Owl3Config, SiglipVisionConfig
from .hyper import LazyVisualKV, VisualInputs, frame_rope_positions, visible_frames
from .modeling import Owl3Model
from .qwen2 import AttentionHooks, TextKVCache

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
