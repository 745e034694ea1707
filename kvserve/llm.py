"""LLM: the offline API. ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import atexit
import functools
import gc
import logging
import weakref
from collections.abc import Sequence

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    KVTransferConfig,
    QuantConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
)
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.memory_controls import check_cache_salt
from kvserve.engine.request_intake import PromptType
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import read_chat_template


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", seed: int = 0, block_size: int | None = None,
                 kv_cache_memory: int | str | None = None, gpu_memory_utilization: float = 0.90,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute", window_kv: str = "free",
                 kv_eviction: str = "none", kv_policy: str = "manual", swap_space: int | str = "4GiB",
                 kv_quality_floor: str = "int4", max_num_seqs: int = 256, decode_reserve: float | None = None,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_chunked_prefill: bool = True, show_progress: bool = True,
                 attention_backend: str = "auto", enforce_eager: bool = False,
                 cuda_graph_max_batch: int | None = None, cuda_graph_capture: str = "startup",
                 cpu_kv_memory: int | str = 0,
                 disk_kv_dir: str | None = None, disk_kv_size: int | str = "16GiB",
                 redis_url: str | None = None, idle_offload_seconds: float = 30.0,
                 max_sessions: int = 4096, session_ttl_seconds: float = 3600.0,
                 max_pinned_fraction: float = 0.25, pin_ttl_seconds: float = 3600.0,
                 kv_tier_secret: str | None = None, kv_tier_encrypt: bool = False,
                 kv_cache_dtype: str = "auto", kv_group_size: int = 0, kv_scales: str | None = None,
                 async_scheduling: bool | None = None, kernel: KernelConfig | None = None,
                 chat_template: str | None = None, speculative_config: dict | SpeculativeConfig | None = None,
                 enable_sleep_mode: bool = False,
                 kv_transfer_config: dict | str | KVTransferConfig | None = None,
                 quantization: str | None = None, quantization_group_size: int | None = None,
                 quantization_head: str | None = None, tensor_parallel_size: int = 1):
        cache = CacheConfig(
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, kv_group_size=kv_group_size, kv_scales=kv_scales,
            kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory, "kv_cache_memory"),
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode, window_kv=window_kv, kv_eviction=kv_eviction,
            kv_policy=kv_policy, kv_quality_floor=kv_quality_floor,
            swap_space=parse_size(swap_space, "swap_space"),
            cpu_kv_memory=(0 if str(cpu_kv_memory).strip().lower() in ("0", "", "0b", "none", "off")
                           else parse_size(cpu_kv_memory, "cpu_kv_memory")),
            disk_kv_dir=disk_kv_dir, disk_kv_size=parse_size(disk_kv_size, "disk_kv_size"),
            redis_url=redis_url, idle_offload_seconds=idle_offload_seconds, max_sessions=max_sessions,
            session_ttl_seconds=session_ttl_seconds,
            max_pinned_fraction=max_pinned_fraction, pin_ttl_seconds=pin_ttl_seconds,
            kv_tier_secret=kv_tier_secret, kv_tier_encrypt=kv_tier_encrypt)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                decode_reserve=decode_reserve)
        self.config = EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed,
                                   cache=cache, scheduler=sched, show_progress=show_progress,
                                   attention_backend=attention_backend, enforce_eager=enforce_eager,
                                   cuda_graph_max_batch=cuda_graph_max_batch,
                                   cuda_graph_capture=cuda_graph_capture, async_scheduling=async_scheduling,
                                   kernel=kernel or KernelConfig(), enable_sleep_mode=enable_sleep_mode,
                                   tensor_parallel_size=tensor_parallel_size,
                                   quantization=_quant_config(quantization, quantization_group_size,
                                                              quantization_head),
                                   speculative=(speculative_config
                                                if isinstance(speculative_config, (SpeculativeConfig, type(None)))
                                                else SpeculativeConfig.from_dict(speculative_config)),
                                   kv_transfer_config=(kv_transfer_config
                                                       if isinstance(kv_transfer_config, (KVTransferConfig, type(None)))
                                                       else KVTransferConfig.from_dict(kv_transfer_config)))
        self.engine = LLMEngine(self.config)
        self.config = self.engine.config  # with the device's defaults resolved
        if chat_template is not None:  # a file or the template text; replaces the model's own
            if self.engine.tokenizer is None:
                raise ConfigError("chat_template", "this model has no tokenizer to apply it with")
            self.engine.tokenizer.chat_template = read_chat_template(chat_template)
        self._counter = 0
        self._shut_down = False
        # A script that simply ends still leaves its prefixes in the tiers: the write-through
        # queue is drained at exit (daemon threads still run while atexit hooks do). The LLM is
        # held weakly, so the hook does not keep the engine alive; once it is gone, its store's
        # queued writes are still waited for (the store lives on with its threads anyway).
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self), self.engine.store)
        # The engine's start-up froze the heap, itself included (see LLMEngine.__init__); its
        # objects form cycles, which a frozen heap never collects. Once this LLM is dropped, the
        # collector sees the whole heap again, so `del llm; gc.collect()` frees its device memory.
        weakref.finalize(self, gc.unfreeze)
        if self.engine.store is not None:
            atexit.register(self._at_exit)

    def shutdown(self) -> None:
        """Write what the KV tiers lack of the GPU prefix cache and wait for the writes (a restart
        or another replica finds it). Idempotent; also runs at interpreter exit and on leaving a
        ``with LLM(...) as llm:`` block. Tensor-parallel workers stop here."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self._at_exit)
        try:
            self.engine.flush_kv_to_tiers()
        finally:
            self.engine.close()

    def sleep(self, level: int = 1) -> None:
        """Give the GPU memory back (needs ``enable_sleep_mode=True``): level 1 keeps the
        weights in pinned host memory, level 2 drops them (waking reloads them from the model
        or snapshot). The KV cache is discarded, after the KV tiers (if on) have taken it.
        Refused while requests run; a no-op while asleep."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``tags`` of ["weights", "kv_cache"] (None: both); a no-op while awake.
        ``generate`` wakes a sleeping engine by itself."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self):
        return self.engine.stats

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, session_id: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order.
        ``session_id`` (one prompt): the conversation this turn belongs to; when it stays idle
        its KV leaves the GPU for the tiers, and its next turn loads it back. A dict prompt may
        carry ``"cache_salt"`` (vLLM's key): only prompts with the same salt share cached KV."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError("prompts", f"must be a string, a dict, a list of token ids or a list of "
                                      f"those, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        if session_id is not None and len(prompts) != 1:
            raise InvalidRequestError("session_id", f"names one conversation: give one prompt, got {len(prompts)}")
        # Validate everything first: a bad prompt must not leave half a batch in the engine.
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        for (_, ids), sp in zip(tokenized, params):
            self.engine.validate(ids, sp)
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        for salt in salts:
            check_cache_salt(salt)
        ids_by_order = []
        for (text, ids), sp, salt in zip(tokenized, params, salts):
            rid = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, sp, session_id=session_id,
                                    cache_salt=salt)
            ids_by_order.append(rid)
        return self._run(ids_by_order, use_tqdm and self.config.show_progress)

    def pin_prefix(self, prompt: PromptType, owner: str = "llm") -> int:
        """Compute ``prompt``'s KV (if not cached) and pin its full blocks in the prefix cache for
        ``owner``: later prompts starting with it hit them however much else runs, until
        ``unpin(owner)``, ``pin_ttl_seconds`` unused, or newer pins needing the budget
        (``max_pinned_fraction`` of the pool). A dict prompt's ``"cache_salt"`` scopes the pin as
        it scopes the cache. Returns the number of tokens pinned (a multiple of the block size)."""
        self.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        return self.engine.pin_prefix(prompt, owner, prompt.get("cache_salt") if isinstance(prompt, dict) else None)

    def unpin(self, owner: str = "llm") -> int:
        """Release ``owner``'s pinned prefixes. Returns how many were released."""
        return self.engine.unpin(owner)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling: str = "mean") -> list[list[float]]:
        """One unit-length embedding per prompt: the model's final hidden states, mean- or
        last-token-pooled (kvserve/engine/pooling.py)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [self.engine.embed(p, pooling, field=f"prompts[{i}]")[0] for i, p in enumerate(prompts)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        ``chat_template_kwargs``: extra template variables, e.g. {"enable_thinking": False}."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, **(chat_template_kwargs or {}))} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], **template_kwargs) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(request_ids), desc="Generating", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(only_finished=True):
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            s = self.engine.stats
                            bar.set_postfix_str(f"{s.generation_tokens_per_s:.0f} tok/s")
                failed = self.engine.pop_failed()
                if failed:  # the call fails as a whole, as for a bad prompt: nothing is left running
                    for rid in request_ids:
                        self.engine.abort_request(rid)
                    raise next(iter(failed.values()))
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids if r in done]


def _quant_config(method, group_size, head) -> QuantConfig | None:
    """``LLM``'s quantization options as a QuantConfig (None: none asked for). A group size or an
    output-head format without a method to apply them to is refused, naming the option."""
    if method is None:
        if group_size is not None:
            raise ConfigError("quantization_group_size", f"applies to quantization='int4', which is not set; "
                              f"got {group_size!r}")
        if head is not None and head != "none":
            raise ConfigError("quantization_head", f"applies to quantization int8, int4 or fp8, which is not "
                              f"set; got {head!r}")
        return None
    return QuantConfig(method, group_size, "none" if head is None else head)


def _shutdown_at_exit(ref: weakref.ref, store) -> None:
    llm = ref()
    try:
        if llm is not None:
            llm.shutdown()
        else:
            store.flush()
    except Exception:  # noqa: BLE001 - the process is ending either way; say why the flush failed
        logging.getLogger(__name__).exception("writing the KV cache to the tiers at exit failed")
