"""mPLUG-Owl3 in plain PyTorch (no torch.distributed in here)."""
