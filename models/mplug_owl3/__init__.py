"""mPLUG-Owl3 in plain PyTorch: config, SigLIP tower, projector, Qwen2 with hyper-attention (no
torch.distributed). Its record for the app is `family.FAMILY`."""
