"""Tiny Hugging Face pieces for the custom_generate / export / serve tests, built offline: a
byte-level tokenizer with a chat template (no download, no real model) and a tiny exported
model folder."""

from __future__ import annotations

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE tokenizer without merges over printable ASCII and newline: one token per
    character, 99 ids (3 special first), EOS <|im_end|> (2), pad <|endoftext|> (0), a ChatML
    template. Whatever a model samples from it decodes to valid text (no partial UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(chr(c) for c in range(32, 127)) + "\n"
    for ch in byte_level.pre_tokenize_str(text)[0][0]:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_chat_model(dtype=torch.float32, family="llama", seed=0):
    """A tiny random model whose vocabulary is tiny_tokenizer's, EOS <|im_end|>."""
    from jacobi_ext.models import tiny_llama

    tok = tiny_tokenizer()
    model = tiny_llama(
        vocab_size=len(tok), dtype=dtype, family=family, seed=seed, eos_token_id=tok.eos_token_id
    )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok
