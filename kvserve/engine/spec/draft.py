"""DraftModel: a smaller model of the target's vocabulary that proposes drafts by decoding;
method ``draft_model`` loads one, ``layer_skip`` runs the target's own first layers
(``EarlyExit``).

It runs inside the engine with its own KV cache: a pool of as many blocks as the target's (its
blocks are smaller, so it costs the draft's share of the target's KV bytes on top; it is not
part of the profiled budget) with its own block tables, no prefix caching. Per request it keeps
``computed``: the leading tokens whose draft KV is valid.

    propose:  catch up (compute the known tokens past ``computed``: the whole prompt at first)
              and draw draft 1 -> feed it, draw draft 2 -> ... -> draft k (k forward passes)
    after verification the request's ``num_computed_tokens`` bounds what stays valid: drafts it
    accepted are known tokens now, KV of rejected ones is overwritten on the next catch-up.

A greedy request gets the draft's argmax (a point mass); a sampled one a draw from the draft's
softmax at its temperature, with those distributions kept for the rejection rule
(``Request.spec_draft_probs``). Requests that no longer run lose their draft KV (a resumed one
recomputes it); a request the pool cannot hold gets no drafts.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kvserve.config import INT4_GROUP_SIZES, EngineConfig, QuantConfig, SpeculativeConfig
from kvserve.engine import eager_warmup
from kvserve.engine.block_pool import BlockPool
from kvserve.engine.device import default_dtype
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.request import Request
from kvserve.engine.startup import timed
from kvserve.errors import ConfigError
from kvserve.layers.attention import ForwardContext, forward_context
from kvserve.layers.quant_linear import quantize_model
from kvserve.layers.weight_init import loaded_later
from kvserve.models import loader
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sampling_params import MIN_TEMPERATURE


class EarlyExit(nn.Module):
    """The target's first ``n`` layers, then its final norm and LM head (layer-skip
    self-speculation): a draft with no weights of its own, a step costing about ``n / L`` of
    the target's. Its KV for those layers equals the target's, but lives in the draft's own
    cache: the target's blocks for the drafted positions are allocated only after proposing."""

    def __init__(self, target: nn.Module, n: int):
        super().__init__()
        if not isinstance(target, LlamaForCausalLM):
            raise ConfigError("speculative_config.method", f"'layer_skip' needs a Llama-family model "
                              f"(llama, qwen2, qwen3), not {target.arch.family}")
        if not 1 <= n < target.arch.num_layers:
            raise ConfigError("speculative_config.draft_layers", f"must be in [1, {target.arch.num_layers - 1}] "
                              f"(the target has {target.arch.num_layers} layers), got {n}")
        self.arch = replace(target.arch, num_layers=n)
        self.embed_tokens, self.norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        self.layers = target.layers[:n]
        self.tp = target.tp  # None: speculative decoding runs on one rank

    forward = LlamaForCausalLM.forward
    compute_logits = LlamaForCausalLM.compute_logits


class DraftModel:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: loader.ModelSource,
                 runner, num_blocks: int):
        self.runner = runner  # the target's: device, dtype, attention backend, metadata builder
        dev, dtype = runner.device, runner.dtype
        if spec.method == "layer_skip":
            self.model = EarlyExit(runner.model, spec.draft_layers)
            self.arch = self.model.arch
        else:
            self.model, self.arch = self._load(config, spec, target, runner)
            runner.pack_for_cpu(self.model)  # as the target is
        self.model.eval()
        self.block_size = config.cache.block_size
        self.kv = KVCache(self.arch, num_blocks, self.block_size, dtype, dev)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.graphs = None  # the draft's decode CUDA graphs, as many rows as the target's
        if runner.graphs is not None:
            from kvserve.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.kv.layers, runner.backend, dev, runner.graphs.max_batch,
                                       runner.graphs.max_blocks, self.block_size, self.arch.num_kv_heads,
                                       rows=True)
            self.graphs.capture_all()  # before serving: the draft's graphs are small
        if dev.type == "cuda" and runner.backend.name == "triton":  # its eager steps' kernels, too
            with timed(runner.startup_seconds, "eager_warmup"):
                scratch = self.pool.allocate(min(eager_warmup.blocks_needed(self.block_size), num_blocks))
                eager_warmup.warm_eager(runner, scratch, model=(self.model, self.kv.layers))
                self.pool.free(scratch[::-1])

    @staticmethod
    def _load(config: EngineConfig, spec: SpeculativeConfig, target: loader.ModelSource, runner):
        src = loader.resolve(spec.model)
        if src.arch.vocab_size != target.arch.vocab_size:
            raise ConfigError("speculative_config.model", f"the draft's vocabulary ({src.arch.vocab_size} tokens) "
                              f"differs from the target's ({target.arch.vocab_size}); drafts would be other tokens")
        if src.arch.num_params > target.arch.num_params:
            raise ConfigError("speculative_config.model", f"the draft ({src.arch.num_params:,} parameters) is larger "
                              f"than the target ({target.arch.num_params:,}); it would cost more than it saves")
        with torch.device(runner.device), default_dtype(runner.dtype), loaded_later():
            model = LlamaForCausalLM(src.arch, max_positions=runner.max_model_len)
        if src.kind == "dummy":
            # Not the target's seed: a random draft of the target's own preset would equal it.
            loader.init_dummy_weights(model, config.seed + 1)
        else:
            with torch.no_grad():
                model.load_weights(loader.iter_weights(src))
        if spec.quantization is not None:
            DraftModel._quantize(model, src, spec.quantization)
        return model, src.arch

    @staticmethod
    def _quantize(model: nn.Module, src: loader.ModelSource, method: str) -> None:
        """The draft's projections rounded to ``method`` at load (``speculative_config.quantization``);
        int4 in the largest group size that divides every projection's input."""
        if src.quant_method:
            raise ConfigError("speculative_config.quantization", f"the draft {src.name} is already quantized "
                              f"({src.quant_method}); leave quantization unset")
        group = None
        if method == "int4":
            widths = src.arch.projection_input_widths
            group = next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if not any(k % g for k in widths)), None)
            if group is None:
                raise ConfigError("speculative_config.quantization", f"int4 needs a group size of "
                                  f"{', '.join(map(str, INT4_GROUP_SIZES))} dividing the draft's projections "
                                  f"(widths {', '.join(map(str, sorted(set(widths))))}); use int8")
        quantize_model(model, QuantConfig(method, group))

    def drop(self, rid: str) -> None:
        self.pool.free(self.tables.pop(rid, [])[::-1])
        self.computed.pop(rid, None)

    def _reserve(self, rid: str, num_tokens: int) -> bool:
        table = self.tables.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    @torch.inference_mode()
    def propose(self, want: list[tuple[Request, int]], running: list[Request]) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs``) of each (request, k) in ``want``."""
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.tables if rid not in live]:
            self.drop(rid)
        reqs, ks = [], []
        for r, k in want:
            rid = r.request_id
            self.computed[rid] = min(self.computed.get(rid, 0), r.num_computed_tokens)
            # Slots for the known tokens and drafts 1 .. k-1 (draft k is drawn, never fed).
            if self._reserve(rid, r.num_tokens + k - 1):
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Step 0 feeds each request's uncomputed known tokens; step j > 0 its draft j.
        feed = [r.all_token_ids[self.computed[r.request_id]:] for r in reqs]
        active = list(range(len(reqs)))
        rt_gen = self.runner._spec_generator  # unseeded requests' draws
        for _step in range(max(ks)):
            seqs = [(self.computed[reqs[i].request_id], len(feed[i]), self.tables[reqs[i].request_id])
                    for i in active]
            ids = [t for i in active for t in feed[i]]
            logits = self._forward(ids, seqs)
            for row, i in enumerate(active):
                r = reqs[i]
                self.computed[r.request_id] += len(feed[i])
                tok, q = self._draw(r, logits[row], rt_gen)
                drafts[i].append(tok)
                if q is not None:
                    probs[i].append(q)
                feed[i] = [tok]
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
        for r, d, q in zip(reqs, drafts, probs):
            r.spec_token_ids = d
            r.spec_draft_probs = torch.stack(q) if q else None

    def _forward(self, ids: list[int], seqs) -> torch.Tensor:
        """Logits at the last fed position of each sequence. Drafting steps are decode steps (one
        token each) and the catch-up after a verify step a few tokens each: both replay the
        draft's CUDA graphs where the target's runner has graphs (``engine/decode_rows.py``)."""
        rt = self.runner
        hidden, query_start = rt._forward(ids, seqs, model=(self.model, self.kv.layers, self.graphs))
        last = torch.tensor(query_start[1:], device=rt.device) - 1
        with forward_context(ForwardContext(None, [], rt.backend)):
            return self.model.compute_logits(hidden[last]).float()

    @staticmethod
    def _draw(r: Request, logits: torch.Tensor, fallback: torch.Generator) -> tuple[int, torch.Tensor | None]:
        t = r.params.temperature
        if t < MIN_TEMPERATURE:
            return int(logits.argmax()), None
        q = (logits / t).softmax(dim=-1).cpu()
        gen = r.generator if r.generator is not None else fallback
        return int(torch.multinomial(q, 1, generator=gen)), q


