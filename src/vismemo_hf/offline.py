"""Offline tokenizer and processors: a byte-level Qwen2 tokenizer and each family's real processor classes
with local image / video processors and the family's chat template (no hub access)."""

from __future__ import annotations

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]

# The chat template of Qwen2-VL / Qwen2.5-VL (a default system turn); Qwen3-VL's has none.
_QWEN2_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and add_system_prompt is not defined %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN3_TEMPLATE = _QWEN2_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' and add_system_prompt is not defined %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")

def byte_tokenizer():
    """A Qwen2 tokenizer over the 256 byte symbols (no merges) plus Qwen's special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tok


def offline_processor(family: str, tokenizer=None, min_tokens: int = 4, max_tokens: int = 256):
    """The family's processor with local image/video processors and ``tokenizer`` (default: byte-level)."""
    from transformers import Qwen2VLImageProcessor

    from vismemo_hf.families import FAMILIES

    spec = FAMILIES[family]
    tokenizer = tokenizer or byte_tokenizer()
    token_px = spec.patch_size * 2
    size = {"shortest_edge": min_tokens * token_px**2, "longest_edge": max_tokens * token_px**2}
    image = Qwen2VLImageProcessor(size=size, patch_size=spec.patch_size, image_mean=list(spec.image_mean),
                                  image_std=list(spec.image_std))
    video = spec.transformers_class(spec.video_processor_class)()
    return spec.transformers_class(spec.processor_class)(
        image_processor=image, tokenizer=tokenizer, video_processor=video,
        chat_template=_QWEN2_TEMPLATE if spec.system_turn else _QWEN3_TEMPLATE)
