"""A byte-level Hugging Face tokenizer built in code (no download): token id = byte value, so
it fits the tiny checkpoints' 256-token vocabulary, and any text round-trips. Gives the tiny
random models text prompts, stop strings and a chat template, and lets tests render real chat
templates with ``apply_chat_template``."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

SIMPLE_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
"""A chat template of plain bytes (no special tokens: their ids would fall outside 256)."""


def byte_tokenizer(**special_tokens: str) -> PreTrainedTokenizerFast:
    """Token i is byte i; ``special_tokens`` (``bos_token="<s>"``, ...) get ids from 256 on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def save_byte_tokenizer(path: Path, chat_template: str | None = SIMPLE_CHAT_TEMPLATE) -> None:
    """Write the tokenizer (with ``chat_template``) into a checkpoint directory."""
    tokenizer = byte_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
