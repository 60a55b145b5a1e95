"""Llama-3.2-Vision (Mllama) in plain PyTorch: the tiled vision encoder, the projector, the Llama
text model with gated cross-attention layers, the processor and the checkpoint loader (no
torch.distributed). Its record for the app is `family.FAMILY`."""
