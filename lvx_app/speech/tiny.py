"""A tiny random-weight Whisper checkpoint in faster-whisper's published layout (CTranslate2's
model.bin, config.json, vocabulary and tokenizer.json), so the whole speech path runs on a CPU in a
second with nothing fetched: a Whisper of one layer each side with a vocabulary of bytes, Whisper's
special tokens and its timestamps, made with transformers and converted by CTranslate2's own
converter. Its transcript is as meaningless as the tiny vision-language model's answers: it proves
the path, not the words. `lvx demo --examples` writes one; the tests make theirs with it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SPECIALS = [
    "<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
    "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
]  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyz\u0120"  # and the space, as byte-level BPE spells it
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def _tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer of the 256 bytes and Whisper's special tokens, with the files
    transformers' fast tokenizer reads; returns the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + TIMESTAMPS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0], unk_token=SPECIALS[0]
    )
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def _mostly_letters(model, folder: Path) -> None:
    """Make the (tied) output rows of letters, the space and the end of text long and the others
    short, so that random weights write words of letters that end, not bytes of broken UTF-8."""
    import torch
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    wanted = [tok.convert_tokens_to_ids(ch) for ch in LETTERS] + [256]
    with torch.no_grad():
        rows = model.get_decoder().get_input_embeddings().weight
        rows.mul_(0.2)
        rows[wanted] *= 20


def make_tiny_whisper(out: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (made if missing); returns its folder."""
    import torch
    from ctranslate2.converters import TransformersConverter
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp)
        vocab = _tokenizer(hf)
        eot, sot = 256, 257
        config = WhisperConfig(
            vocab_size=vocab, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448,
            decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
            suppress_tokens=[], begin_suppress_tokens=[eot],
        )  # fmt: skip
        torch.manual_seed(seed)
        model = WhisperForConditionalGeneration(config)
        model.generation_config = GenerationConfig(
            decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot,
            suppress_tokens=[], begin_suppress_tokens=[eot], alignment_heads=[[0, 0], [0, 1]],
            lang_to_id={},
        )  # fmt: skip
        _mostly_letters(model, hf)
        model.save_pretrained(str(hf))
        (hf / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80}))
        converter = TransformersConverter(str(hf), copy_files=["tokenizer.json"])
        converter.convert(str(out), quantization="float32", force=True)
    return out
