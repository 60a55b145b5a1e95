"""Model families in plain PyTorch (no torch.distributed in here): mplug_owl3 (mPLUG-Owl3) and
mllama (Llama-3.2-Vision)."""
