"""A small byte-level BPE tokenizer trained on the spot with Hugging Face ``tokenizers``, for the
random-weight ``dummy:tiny`` model (vocabulary 512): real multi-byte tokens, an end-of-text token
at the model's id 0 and a chat template, so grammar-constrained decoding and chat can run on a
model that loads in a second."""
from __future__ import annotations

import json
import os

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _corpus() -> list[str]:
    docs = [json.dumps({"name": "Ada", "age": 36, "tags": ["math", "engine"], "ok": True, "score": -1.5e3}),
            json.dumps({"id": 7, "items": [{"k": "v"}, None, 3.25], "nested": {"a": {"b": "c"}}}, indent=2),
            "The quick brown fox jumps over the lazy dog. 0123456789 red green blue yes no maybe",
            "user@example.com 2026-12-03 +1-555-0100 {\"key\": \"value\"} [1, 2, 3] \\u00e9 \u00e9\u00e8 \u4e2d\u6587"]
    return docs * 20


def build(path: str, vocab_size: int = 400) -> str:
    """Train and save the tokenizer under ``path``; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path
