"""Structured outputs: what a JSON-schema grammar costs.

Three measurements in one run:
- the same prompts with and without a JSON schema at each batch of ``--batches``, best of
  ``--repeats`` alternated runs, sampled at temperature 1: output tokens/s, and the median time
  of a decode step with every row of the batch running (the grammar's own cost per step). The
  default schema (``long_records``) cannot end within ``--max-tokens``, so constrained and free
  requests run the same number of steps; with a schema that ends early (``records``) the
  constrained batch also spends steps with fewer rows, which lowers its tokens/s but not its
  step time;
- the host time to fill one step's token bitmask for a batch's matchers (what the device's
  forward has to hide), the median time a constrained step's host path waited for its mask
  (what was not hidden), and the engine thread's CPU time per full step (the host's share of
  a step, free and constrained);
- grammar compile time per schema, cold (a fresh compiler) and cached.

    python benchmarks/structured.py                                   # default model, CPU
    python benchmarks/structured.py --model dummy:tiny --batches 1,16 # seconds, on a small tokenizer
    python benchmarks/structured.py --model dummy:vocab-128k          # CPU: Llama 3's vocabulary, 2 thin layers
    python benchmarks/structured.py --model dummy:vocab-128k --stub-forward --temperature 0 --async-scheduling on
                                                   # CPU: the engine's host path alone, as on a GPU
    PYTHONPATH=$PWD python benchmarks/structured.py --model dummy:llama-3-8b --out $OUT   # GPU

Dummy models borrow a tokenizer: the default model's (49,152 tokens, padded to the model's
vocabulary) where it is installed and fits, else the byte-level one the tests train.
``dummy:vocab-128k`` is defined here, not in the engine: a model whose LM head and token mask
dominate a CPU step the way they do a batch-64 step on a GPU. ``--stub-forward`` replaces its
forward with zeros and its LM head with fixed random logits, so that a CPU step is the engine's
host work plus the sampling (greedy with ``--temperature 0``), as the host sees a GPU step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"]},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "score": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["id", "address", "tags"]},
    "records": {"type": "array", "minItems": 4, "maxItems": 8, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "label": {"enum": ["red", "green", "blue"]}},
        "required": ["x", "label"]}},
    # Never ends within 128 tokens: every row runs the whole step count, as free rows do.
    "long_records": {"type": "array", "minItems": 40, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "label": {"enum": ["red", "green", "blue"]}},
        "required": ["x", "label"]}},
    "recursive": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"v": {"type": "integer"},
                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}},
}


# A CPU stand-in for a large model at batch 64: Llama 3's vocabulary on two thin layers.
VOCAB_128K = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def register_presets() -> None:
    from kvserve.models.presets import DUMMY_PRESETS
    DUMMY_PRESETS.setdefault("vocab-128k", VOCAB_128K)


def borrowed_tokenizer(model: str | None) -> str | None:
    if model is None or not model.startswith("dummy:"):
        return None
    from kvserve.errors import ModelLoadError
    from kvserve.models.loader import default_model_path, resolve
    if resolve(model).arch.vocab_size >= 49152:
        try:
            return default_model_path()
        except ModelLoadError:
            pass  # not installed here: the byte-level one, padded
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from byte_tokenizer import build
    return build(tempfile.mkdtemp(prefix="kvserve-bench-tok-"))


_ids = iter(range(1 << 62))
MASK_WAITS: list[float] = []  # seconds each step's host path waited for its token mask


def record_mask_waits() -> None:
    """Time what a step waits for its mask: the whole fill where it runs in line (builds before
    ``BitmaskFiller.start``), else the wait for the fill running beside the forward."""
    from kvserve.structured import grammar
    filler = grammar.BitmaskFiller
    if not hasattr(filler, "start"):
        fill = filler.__call__

        def timed_call(self, *args):
            t0 = time.perf_counter()
            mask = fill(self, *args)
            MASK_WAITS.append(time.perf_counter() - t0)
            return mask
        filler.__call__ = timed_call
        return
    start = filler.start

    def timed_start(self, *args):
        job = start(self, *args)
        result = job.result

        def timed_result(*a):
            t0 = time.perf_counter()
            out = result(*a)
            MASK_WAITS.append(time.perf_counter() - t0)
            return out
        job.result = timed_result
        return job
    filler.start = timed_start


def stub_forward(llm: LLM, seed: int = 0) -> None:
    """The model's forward returns zeros and its LM head fixed random logits (one row per
    position of the batch): a CPU step is then the engine's host work and the sampling."""
    runner = llm.engine.runner
    hidden, vocab = runner.arch.hidden_size, runner.arch.vocab_size
    table = torch.randn(1024, vocab, generator=torch.Generator().manual_seed(seed))
    runner.model.forward = lambda ids, positions: torch.zeros(ids.shape[0], hidden)
    runner.model.compute_logits = lambda h: table[:h.shape[0]].clone()


def run_batch(llm: LLM, batch: int, max_tokens: int, schema: dict | None, temperature: float = 1.0) -> dict:
    """``batch`` requests at once: output tok/s, and the median decode step with all of them
    running (each step() call timed: with async scheduling a call is one step's period)."""
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    # Unseeded: a seeded row draws its noise on its own, which would be timed too.
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=so is None,
                            structured_outputs=so)
    eng = llm.engine
    rids = [f"bench-{next(_ids)}" for _ in range(batch)]
    t0 = time.perf_counter()
    for i, rid in enumerate(rids):
        eng.add_request(rid, f"Record {i} as JSON:", params)
    outs, steps, cpu = {}, [], []
    MASK_WAITS.clear()
    while eng.has_unfinished_requests():
        ts, cs = time.perf_counter(), time.thread_time()
        for o in eng.step(only_finished=True):
            outs[o.request_id] = o
        last = eng.stats.last
        if last is not None and last.num_prompt_tokens == 0 and last.num_generated_tokens == batch:
            steps.append(time.perf_counter() - ts)
            cpu.append(time.thread_time() - cs)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs.values())
    if so is not None:
        for o in outs.values():  # the grammar held: every finished output parses
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)
    steps.sort()
    cpu.sort()
    waits = sorted(MASK_WAITS)
    return {"tok_s": n / dt, "tokens": n, "seconds": dt, "full_steps": len(steps),
            "step_ms": steps[len(steps) // 2] * 1e3 if steps else float("nan"),
            "step_cpu_ms": cpu[len(cpu) // 2] * 1e3 if cpu else float("nan"),
            "mask_wait_ms": waits[len(waits) // 2] * 1e3 if waits else 0.0}


def fill_time(llm: LLM, batch: int, schema: dict, reps: int = 50) -> float:
    """Seconds to fill one step's bitmask for ``batch`` matchers, each a few tokens into the
    output (past the grammar's fixed prefix)."""
    from kvserve.structured import BitmaskFiller
    eng = llm.engine
    spec = StructuredOutputsParams(json=schema)
    states = []
    for _ in range(batch):
        g = eng.structured.matcher(spec)
        g.accept(eng.tokenizer.encode('{"name": "ab', add_special_tokens=False))
        states.append(g)
    filler = BitmaskFiller(eng.arch.vocab_size, eng.runner.device)
    rows = list(range(batch))
    filler(batch, rows, states)
    t0 = time.perf_counter()
    for _ in range(reps):
        filler(batch, rows, states)
    return (time.perf_counter() - t0) / reps


def compile_times(llm: LLM) -> dict:
    from kvserve.structured import StructuredCompiler
    eng = llm.engine
    out = {}
    t0 = time.perf_counter()
    fresh = StructuredCompiler(eng.tokenizer, eng.arch.vocab_size, eng.eos_token_ids)
    fresh.compile(StructuredOutputsParams(regex="a"))  # the tokenizer's info, built once per engine
    out["tokenizer_info_s"] = time.perf_counter() - t0
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        fresh._cache.clear()
        t0 = time.perf_counter()
        fresh.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.compile(StructuredOutputsParams(json=json.dumps(schema)))  # same spec, written as text
        out[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - t0) * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None, help="default: the model's (dummy models borrow one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--schema", default="long_records", choices=sorted(SCHEMAS))
    ap.add_argument("--async-scheduling", default=None, type=lambda v: v == "on", choices=[True, False],
                    metavar="{on,off}", help="default: the engine's (on with CUDA)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--stub-forward", action="store_true",
                    help="zeros for the forward, fixed random logits for the LM head: the host's work alone")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--out", default="benchmarks/results", help="folder for structured.json")
    args = ap.parse_args()

    register_presets()
    record_mask_waits()
    batches = sorted({int(b) for b in args.batches.split(",")})
    tok = args.tokenizer or borrowed_tokenizer(args.model)
    llm = LLM(args.model, tokenizer=tok, device=args.device, max_num_seqs=max(batches),
              kv_cache_memory=args.kv_cache_memory, async_scheduling=args.async_scheduling, show_progress=False)
    if args.stub_forward:
        stub_forward(llm)
    dev = llm.engine.runner.device
    schema = SCHEMAS[args.schema]
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model or "SmolLM2-135M-Instruct (default)",
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "async_scheduling": llm.engine.config.async_scheduling,
              "schema": args.schema, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "temperature": args.temperature, "stub_forward": args.stub_forward,
              "compile": compile_times(llm)}
    run_batch(llm, 2, 8, schema)  # warm-up: kernels, the grammar's cache entry
    run_batch(llm, 2, 8, None)
    rows = []
    for batch in batches:
        # Alternated, best of --repeats each: a shared machine's noise hits both alike.
        plain, constrained = [], []
        for _ in range(args.repeats):
            plain.append(run_batch(llm, batch, args.max_tokens, None, args.temperature))
            constrained.append(run_batch(llm, batch, args.max_tokens, schema, args.temperature))
        p = max(plain, key=lambda r: r["tok_s"])
        c = max(constrained, key=lambda r: r["tok_s"])
        p_step = min(r["step_ms"] for r in plain)
        c_step = min(r["step_ms"] for r in constrained)
        c_wait = min(r["mask_wait_ms"] for r in constrained)
        p_cpu = min(r["step_cpu_ms"] for r in plain)
        c_cpu = min(r["step_cpu_ms"] for r in constrained)
        fill = fill_time(llm, batch, SCHEMAS["flat"])
        rows.append({"batch": batch, "plain_tok_s": p["tok_s"], "plain_tokens": p["tokens"],
                     "json_tok_s": c["tok_s"], "json_tokens": c["tokens"],
                     "json_over_plain": c["tok_s"] / p["tok_s"],
                     "plain_step_ms": p_step, "json_step_ms": c_step, "json_step_over_plain": c_step / p_step,
                     "mask_wait_ms": c_wait, "plain_step_cpu_ms": p_cpu, "json_step_cpu_ms": c_cpu,
                     "runs": {"plain": plain, "json": constrained},
                     "bitmask_fill_ms": fill * 1e3})
    result["throughput"] = rows
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "structured.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)

    print(f"\n{result['model']} on {result['device']}, schema {args.schema!r}, up to {args.max_tokens} tokens, "
          f"temperature {args.temperature:g}{', stubbed forward' if args.stub_forward else ''}, "
          f"async scheduling {'on' if result['async_scheduling'] else 'off'}")
    print(f"{'batch':>6}{'plain tok/s':>13}{'JSON tok/s':>12}{'ratio':>7}{'plain step ms':>15}"
          f"{'JSON step ms':>14}{'ratio':>7}{'mask fill ms':>14}{'mask wait ms':>14}{'host ms free/JSON':>19}")
    for r in rows:
        print(f"{r['batch']:>6}{r['plain_tok_s']:>13.1f}{r['json_tok_s']:>12.1f}{r['json_over_plain']:>7.3f}"
              f"{r['plain_step_ms']:>15.2f}{r['json_step_ms']:>14.2f}{r['json_step_over_plain']:>7.3f}"
              f"{r['bitmask_fill_ms']:>14.3f}{r['mask_wait_ms']:>14.3f}"
              f"{r['plain_step_cpu_ms']:>10.3f} /{r['json_step_cpu_ms']:>7.3f}")
    print(f"\ntokenizer info for the grammar compiler: {result['compile']['tokenizer_info_s'] * 1e3:.0f} ms")
    print(f"{'schema':<12}{'cold ms':>10}{'cached ms':>11}")
    for name in SCHEMAS:
        c = result["compile"][name]
        print(f"{name:<12}{c['cold_ms']:>10.2f}{c['cached_ms']:>11.3f}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
