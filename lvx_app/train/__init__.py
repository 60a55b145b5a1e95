"""Finetuning mPLUG-Owl3 on long videos through LV-XAttn, with visual K/V recomputed in backward.

data.py (JSONL + chat template + assistant-only labels), recompute.py (training attention hooks, the recompute
autograd Function, rematerialisation-aware layer checkpointing), loop.py (sharded step, DDP, optimiser, loop,
torchrun worker), checkpoint.py (official-layout save + resume state), cli.py (`lvx finetune`).
"""

from lvx_app.train.data import Sample, Tokenized, load_jsonl, tokenize
from lvx_app.train.loop import TrainConfig, Trainer, run_training
from lvx_app.train.recompute import TrainAttention, checkpoint_lm_blocks

__all__ = ["Sample", "Tokenized", "TrainAttention", "TrainConfig", "Trainer", "checkpoint_lm_blocks",
           "load_jsonl", "run_training", "tokenize"]
