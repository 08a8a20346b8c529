"""Offline tokenizer and processors: a byte-level tokenizer with a family's special tokens and each family's real
processor classes with local image / video processors and the family's chat template (no hub access)."""

from __future__ import annotations

#: the special tokens of the Qwen-VL chat format (``families.base.ModelAdapter.special_tokens``)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]


def byte_tokenizer(special_tokens=None, eos_token: str = "<|im_end|>", pad_token: str = "<|endoftext|>"):
    """A Qwen2 tokenizer over the 256 byte symbols (no merges) plus ``special_tokens`` (default: Qwen's)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = list(special_tokens or SPECIAL_TOKENS)
    symbols = bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    for tok in specials:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=eos_token, pad_token=pad_token)
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t != pad_token]})
    return tok


def offline_processor(family: str, tokenizer=None, min_tokens: int = 4, max_tokens: int = 256, vision=None):
    """The family's processor with local image/video processors and ``tokenizer`` (default: byte-level with the
    family's special tokens); ``vision``: the model's vision config, for families whose processor follows it."""
    from vismemo_hf.families import FAMILIES

    adapter = FAMILIES[family]
    tokenizer = tokenizer or byte_tokenizer(adapter.special_tokens, adapter.eos_token, adapter.pad_token)
    return adapter.offline_processor(tokenizer, min_tokens, max_tokens, vision=vision)
