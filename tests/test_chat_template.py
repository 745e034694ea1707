"""--chat-template / LLM(chat_template=...): a file or the template text replaces the model's own,
and chat_template_kwargs reach it as variables."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.errors import ConfigError

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not (enable_thinking | default(true)) %}"
            "<think></think>{% endif %}{% endif %}")
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("as_file", [True, False])
def test_template_replaces_the_models(model_path, tmp_path, as_file):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    llm = LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False,
              chat_template=str(path) if as_file else TEMPLATE)
    tok = llm.get_tokenizer()
    assert tok.decode(llm.apply_chat_template(HI)) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(llm.apply_chat_template(HI, enable_thinking=False)).endswith("assistant\n<think></think>")


def test_neither_file_nor_template(model_path, tmp_path):
    with pytest.raises(ConfigError, match="chat_template"):
        LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False,
            chat_template=str(tmp_path / "missing.jinja"))
