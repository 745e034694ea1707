"""``speculative_config``: speculative decoding's options, with vLLM's names (kvserve/spec)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import ConfigError, check_option_dict

_SPEC_METHODS = ("ngram", "draft_model", "layer_skip")
DRAFT_QUANTIZATION = ("int8", "int4")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (kvserve/spec), with vLLM's names. ``ngram``: drafts copied from
    earlier in the prompt and output (prompt lookup); ``draft_model``: a smaller model of the
    same vocabulary proposes them; ``layer_skip``: the target's own first ``draft_layers``
    layers and its LM head propose them (no second model). Lossless in every case: the target
    model verifies every draft."""
    method: str
    num_speculative_tokens: int  # the most drafts per step; the policy may propose fewer
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 5  # ngram: the longest
    model: str | None = None  # draft_model: GGUF file, HF directory or dummy:<preset>
    draft_layers: int | None = None  # layer_skip: how many of the target's first layers draft
    # draft_model: its projections rounded at load to "int8" (per channel) or "int4" (asymmetric
    # groups of the largest of 128, 64, 32 that divides them); None: as the checkpoint has them.
    # A draft's precision moves only how many drafts are kept, never the output (the target
    # verifies every one), and a decode step of it reads half or a quarter of the bytes.
    quantization: str | None = None
    # No drafts while more requests than this are decoding: a verify step of B * (k + 1) tokens
    # stops being as cheap as a 1-token step once the batch alone fills the device. None: from
    # ``verify_token_budget``.
    disable_by_batch_size: int | None = None
    # Tokens a verify step may carry (batch x (1 + drafts)) before it costs more than a plain
    # decode step; the per-step k is capped by it. The default is the token count where a
    # decode step of an 8B model stops being bound by reading the weights on an H100-class GPU.
    verify_token_budget: int = 128

    _FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
               "draft_layers", "quantization", "disable_by_batch_size", "verify_token_budget")

    @classmethod
    def from_dict(cls, d) -> SpeculativeConfig:
        """``speculative_config`` as the user wrote it (a dict, as in vLLM)."""
        check_option_dict(d, "speculative_config", cls._FIELDS, ("method", "num_speculative_tokens"))
        return cls(**d)

    def __post_init__(self):
        def bad(name, msg):
            raise ConfigError(f"speculative_config.{name}", msg)

        def int_in(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                bad(name, f"must be an integer {bound}, got {v!r}")

        if self.method not in _SPEC_METHODS:
            bad("method", f"must be one of {', '.join(_SPEC_METHODS)}; got {self.method!r}")
        int_in("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        int_in("prompt_lookup_min", 1, 64)
        int_in("prompt_lookup_max", 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}")
        if self.disable_by_batch_size is not None:
            int_in("disable_by_batch_size", 1, None)
        int_in("verify_token_budget", 2, None)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                bad("model", "method 'draft_model' needs the draft's path or dummy:<preset>")
        elif self.model is not None:
            bad("model", f"only method 'draft_model' takes a model; method is {self.method!r}")
        if self.quantization is not None:
            if self.method != "draft_model":
                bad("quantization", f"quantizes a draft model's weights; method {self.method!r} has none of its own")
            if self.quantization not in DRAFT_QUANTIZATION:
                bad("quantization", f"must be one of {', '.join(DRAFT_QUANTIZATION)} or None; "
                    f"got {self.quantization!r}")
        if self.method == "layer_skip":
            if self.draft_layers is None:
                bad("draft_layers", "method 'layer_skip' needs draft_layers, the number of the target's first "
                    "layers that draft (fewer than it has)")
            int_in("draft_layers", 1, None)  # the upper bound, the target's layers - 1, is checked at load
        elif self.draft_layers is not None:
            bad("draft_layers", f"only method 'layer_skip' takes draft_layers; method is {self.method!r}")

    @property
    def max_batch(self) -> int:
        """The largest decoding batch that still speculates."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return self.verify_token_budget // 2  # one draft per request at least
