"""What a request must be before it enters the engine: its prompt tokenized, every field checked
against the model, the context and the KV pool, each failure an error naming the field and the
allowed range. Also the embeddings endpoint's forward, which takes a prompt the same way."""
from __future__ import annotations

from kvserve.engine import kv_policy
from kvserve.engine.pooling import POOLINGS, EmbeddingJob
from kvserve.errors import InvalidRequestError
from kvserve.kv_eviction import kv_budget_min
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import check_text

PromptType = str | list[int] | dict


class RequestIntake:
    """LLMEngine's request checks (the engine holds the config, tokenizer, architecture,
    scheduler, structured-output compiler, speculator and runner)."""

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=True)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequestError("prompt", f"must be a string, a list of token ids or a dict, "
                                  f"got {type(prompt).__name__}")

    def embedding(self, prompt: PromptType, pooling: str = "mean", field: str = "input") -> EmbeddingJob:
        """The prompt checked and tokenized, as an embedding to compute a chunk at a time
        (engine/pooling.py): call ``embedding_step`` on the engine's thread until it is done."""
        if pooling not in POOLINGS:
            raise InvalidRequestError("pooling", f"must be one of {POOLINGS}, got {pooling!r}")
        _, ids = self.tokenize_prompt(prompt)
        vocab = self.arch.vocab_size
        if not ids:
            raise InvalidRequestError(field, "must not be empty")
        if any(type(t) is not int or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(field, f"has {len(ids)} tokens; at most max_model_len ({self.max_model_len}) fit")
        return EmbeddingJob(self.runner, ids, pooling, self.config.scheduler.max_num_batched_tokens)

    def embedding_step(self, job: EmbeddingJob) -> None:
        self._wake_for_work()  # an idle engine may have gone to sleep between two chunks
        job.step()

    def embed(self, prompt: PromptType, pooling: str = "mean", field: str = "input") -> tuple[list[float], int]:
        """(the prompt's embedding, its number of tokens), every chunk in this call."""
        job = self.embedding(prompt, pooling, field)
        while not job.done:
            self.embedding_step(job)
        return job.result(), len(job.ids)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Every check a request must pass before it enters the engine; returns ``params`` as the
        request runs (with the budget ``kv_policy`` auto gives it, if any)."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.arch.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequestError("prompt", f"has {n} tokens; max_model_len is {self.max_model_len}, "
                                      f"so at most {self.max_model_len - 1} prompt tokens fit",
                                      code="context_length_exceeded")
        mt = params.max_tokens
        if mt is not None and n + mt > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({mt}) = {n + mt} exceeds "
                                      f"max_model_len {self.max_model_len}; "
                                      f"allowed max_tokens <= {self.max_model_len - n}",
                                      code="context_length_exceeded")
        # The budget kv_policy auto gives a request too long for its share (kv_quality_floor
        # eviction) counts here as the request's own would.
        params = kv_policy.budget_for(self.kv_policy, params, n, self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
        if params.kv_budget is not None:
            lo = kv_budget_min(self.config.cache.block_size)
            if self.config.cache.kv_eviction == "none":
                raise InvalidRequestError("kv_budget", "needs the server started with --kv-eviction "
                                          "streaming, snapkv or h2o")
            if not lo <= params.kv_budget <= self.max_model_len:
                raise InvalidRequestError("kv_budget", f"must be an integer in [{lo}, {self.max_model_len}] "
                                          f"(two blocks and the step's token; at most "
                                          f"max_model_len), got {params.kv_budget}")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # a spec that does not compile stops here
        if self.speculator is not None:
            if params.n > 1:
                raise InvalidRequestError("n", f"must be 1 with speculative decoding on, got {params.n}")
            if params.prompt_logprobs is not None:
                raise InvalidRequestError("prompt_logprobs", "is not supported with speculative decoding on")
        longest = mt if mt is not None else self.max_model_len - n
        need = self.scheduler.blocks_to_finish(n, longest, params.n, params.kv_budget)
        if need > self.num_kv_blocks:
            # Name n when one sequence would fit: lowering max_tokens is then not the only way.
            field = "n" if params.n > 1 and self.scheduler.blocks_to_finish(n, longest, 1, params.kv_budget) \
                <= self.num_kv_blocks \
                else "max_tokens"
            raise InvalidRequestError(field, f"the request needs {need} KV blocks at its longest "
                                      f"(prompt {n} + max_tokens {mt} tokens, n={params.n}) but the KV pool "
                                      f"holds {self.num_kv_blocks}; lower max_tokens or n, or raise kv_cache_memory")
        return params
