"""Llama-3.2-Vision (Mllama) in plain PyTorch: the tiled vision encoder, the projector, the Llama
text model with gated cross-attention layers, the processor and the checkpoint loader (no
torch.distributed)."""

from .config import MllamaConfig, MllamaTextConfig, MllamaVisionConfig
from .cross import CrossVisibility
from .modeling import MllamaModel
from .video_model import MllamaVideoModel

__all__ = [
    "CrossVisibility",
    "MllamaConfig",
    "MllamaModel",
    "MllamaTextConfig",
    "MllamaVideoModel",
    "MllamaVisionConfig",
]
