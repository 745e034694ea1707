"""Real model shapes for ``dummy:<preset>`` random weights (benchmarks: speed depends on shape)."""

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

DUMMY_PRESETS: dict[str, dict] = {
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                   "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072,
                   "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009},
    "llama-3-70b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
                    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                    "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072,
                    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "bos_token_id": 151643, "eos_token_id": 151645},
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2},
    # A draft for "tiny" (same vocabulary, a quarter of its width): speculative decoding tests.
    "tiny-draft": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 32,
                   "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "max_position_embeddings": 2048, "tie_word_embeddings": True, "eos_token_id": 0},
    "tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "max_position_embeddings": 2048, "tie_word_embeddings": True, "eos_token_id": 0},
    # Gemma 3 in small: a local layer with an 8-token window, then a global one (window tests).
    "tiny-gemma3": {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 2048,
                    "eos_token_id": 0},
}
