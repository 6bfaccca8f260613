"""Tiny offline models and tokenizer for tests and examples: no downloads, a few MB, fast on CPU.

`tiny_tokenizer()` is a byte-level BPE trained on a fixed corpus (deterministic) with ChatML special tokens
and a chat template; `tiny_llama(seed=...)` is a 2-layer Llama over that vocabulary. Different seeds give
different (untrained, mutually disagreeing) models with the same tokenizer: a target and a draft.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model in one pass.",
    "Question: what is 12 plus 30? Answer: 42. Let's think step by step about the numbers involved.",
    "Write a short poem about the sea, the wind and the stars that guide sailors home at night.",
]


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, vocab_size: int | None = None, **overrides):
    """A random 2-layer Llama (eval mode, fp32). Logits are sharpened so greedy chains are not all ties."""
    from transformers import LlamaForCausalLM

    if vocab_size is None:
        vocab_size = len(tiny_tokenizer())
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size, **overrides)
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).eval()
    return model


def save_tiny(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny model + tokenizer folder (safetensors) and return its path."""
    path = Path(path)
    model = tiny_llama(seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
