"""OpenFlamingo in plain PyTorch: the CLIP ViT-L/14 tower, the perceiver resampler, MPT with gated
cross-attention layers, the processor and the loader of its three published parts (no
torch.distributed). Its record for the app is `family.FAMILY`."""
