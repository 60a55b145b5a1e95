"""Finetuning mPLUG-Owl3 on long videos through LV-XAttn, with visual K/V recomputed in backward.

data.py (JSONL + chat template + assistant-only labels), lora.py (LoRA adapters and their merge),
recompute.py (training attention hooks, the recompute autograd Function, rematerialisation-aware
layer checkpointing), loop.py (sharded step, DDP, optimiser, loop), worker.py (the torchrun rank
entry point), checkpoint.py (official-layout save + resume state), cli.py (`lvx finetune`). Import
the modules themselves: this package root stays empty so `lvx --help` does not load torch for it.
"""
