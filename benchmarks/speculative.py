"""Speculative decoding: what drafts buy at batch 1, and what a verify step costs.

Default mode (CPU or GPU): one target decoding greedily, one request at a time, with drafts off
and with each of ``--methods`` (ngram, draft_model with ``--draft``, layer_skip with
``--draft-layers``), the sides alternated ``--repeats`` times (best kept) and sharing the
target's weights, on four workloads:
- editing: chat prompts that contain the text the answer reproduces (fix a list, rewrite a
  passage): drafts copied from the prompt are often right;
- code: a 20-line Python file and a change to make in it (rename, fix, add type hints), or a
  paragraph to put in the past tense: the answer is the text again, changed;
- chat: open questions, where the answer rarely repeats the prompt;
- held_out: prompts on Python's own documentation topics, tuned for no method.
Prints output tokens/s of every side, each method's speedup and mean acceptance length (tokens
a verify step emits: accepted drafts + 1), and checks all sides emit the same tokens (in float32;
in bfloat16 it records how many leading tokens each prompt's output shares with the off side's,
since rounded logits can tie differently in a verify step: ``batch1``). The JSON
keeps each method's acceptance rate per workload and per draft position (draft j kept, given
the j before it were) for ``--replay``, the load times and the load average. ``--step-costs``
first times, on the loaded models, a verify step of k + 1 tokens against a 1-token step of the
target and each draft model's 1-token step (what a mean acceptance length must beat).

``--replay JSON`` (for a GPU): end to end at ``--batches``, drafts off against drafts accepted as
a batch-1 run measured (synthetic acceptance). The batch-1 run keeps each method's trace: every
decode step's (drafts proposed, drafts kept), in order; each replayed request plays it back
step by step, so the steps propose and keep what the real ones did (the n-gram lookup runs
too, for its host time; the draft model, if ``--draft``, really runs and its drafts are then
kept as traced). A JSON without traces (or ``--replay-rates``) draws instead: the number of
drafts from the run's distribution, and draft j kept with its position's rate while the ones
before it are; that loses how long proposals go with kept ones, and under-replays acceptance
(on the code workload: acceptance length 2.5 replayed against 4.0 measured). Times only.

``--verify-cost`` (for a GPU, e.g. ``--model dummy:llama-3-8b``): the time of one verify step of
``k + 1`` tokens per sequence against a 1-token decode step, for k = 1..8 at batch 1, 8, 32, 128
and a context of ``--context`` tokens, both run as the engine runs them: the decode step and a
verify step whose ``B * (k + 1)`` rows fit a captured CUDA graph replay it (decode rows,
``kvserve/engine/decode_rows.py``; graphs up to ``--graph-rows``), a larger verify step runs
eagerly through the prefill kernel. The peer in the same run is the prefill-shaped verify step
(eager) at every size. The ratio is what a step of k drafts must beat in accepted tokens; it
sets ``verify_token_budget``.

    python benchmarks/speculative.py                                   # CPU, default model, n-gram
    python benchmarks/fetch_qwen_pair.py /tmp/qwen                     # the real pair, then:
    python benchmarks/speculative.py --model /tmp/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --methods ngram,draft_model,layer_skip --draft /tmp/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --draft-layers 20 --step-costs --out $OUT --name speculative_cpu_qwen_pair.json
    python benchmarks/speculative.py --replay benchmarks/results/speculative/speculative_cpu_qwen_pair.json \
        --model dummy:llama-3-8b --methods ngram,draft_model --draft dummy:llama-3.2-1b \
        --max-tokens 128 --out $OUT    # GPU
    python benchmarks/speculative.py --verify-cost --model dummy:llama-3-8b --out $OUT   # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine import decode_rows  # noqa: E402

FRUIT = "apples, pears, plums, cherries, grapes, lemons, limes, peaches, figs, dates, kiwis, mangoes"
EDITING = [
    f"Rewrite this list in alphabetical order, one item per line:\n{FRUIT}",
    "Correct the spelling and repeat the text: The quick brown fox jumpes over the lazy dog. "
    "The quick brown fox jumpes over the lazy dog again and again.",
    "Copy this code and add a docstring:\n\ndef area(width, height):\n    return width * height\n",
    "Summarise, quoting its first sentence: Memory bandwidth decides the cost of decoding. Every "
    "token reads every weight once, so small batches leave the arithmetic units idle.",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
]


# Code editing: a file and a change to make in it; the answer is the file again, changed (the
# workload of an editor's assistant, and the one prompt lookup was made for).
LRU_CACHE = '''class Cache:
    """A fixed-size cache that forgets the least recently used key."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
'''
STATS = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)


def moving_average(values, window):
    out = []
    for i in range(len(values) - window):
        out.append(mean(values[i:i + window]))
    return out
'''
CODE = [
    f"Rename the class `Cache` to `LRUCache` and its method `put` to `insert`. Reply with the whole "
    f"code and nothing else.\n\n```python\n{LRU_CACHE}```",
    f"`moving_average` drops the last window: `range(len(values) - window)` should be "
    f"`range(len(values) - window + 1)`. Fix it and reply with the whole file.\n\n```python\n{STATS}```",
    f"Add type hints (`list[float]`, `int`, `float`) to every function below. Reply with the whole "
    f"file.\n\n```python\n{STATS}```",
    "Rewrite this paragraph in the past tense, changing nothing else:\n\nThe engine reads every weight "
    "once per step, so a small batch leaves the arithmetic units idle. Speculative decoding spends that "
    "idle time: a cheap guess proposes several tokens, and one forward pass of the model checks them all. "
    "When the guesses are right, one step yields several tokens; when they are wrong, the step still "
    "yields one.",
]

# Held out: prompts on Python's own documentation topics, none tuned for either method.
HELD_OUT = [
    "Summarise: The with statement is used to wrap the execution of a block with methods defined by a "
    "context manager. This allows common try...except...finally usage patterns to be encapsulated for "
    "convenient reuse.",
    "Rewrite with a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n"
    "        out.append(x * x)\n    return out\n",
    "What is the difference between a tuple and a list in Python?",
    "Explain what itertools.groupby does, with a short example.",
]
WORKLOADS = {"editing": EDITING, "code": CODE, "chat": CHAT, "held_out": HELD_OUT}
# --replay's drafts are this id plus how many of them the traced step kept (any id the target's
# vocabulary holds: only the time is measured)
TRACE_TOKEN = 1000


def run_side(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs, t0 = [], time.perf_counter()
    for p in prompts:  # batch 1: one request at a time
        outs.append(list(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids))
    return outs, time.perf_counter() - t0


def method_config(name: str, args) -> dict:
    """``name``: a method, or ``method:k`` for its own num_speculative_tokens (one run can then
    compare k for one method, e.g. ``ngram:4,ngram:8``); ``draft_model+int4`` (or ``+int8``)
    quantizes the draft at load (``speculative_config.quantization``)."""
    name, _, k = name.partition(":")
    name, _, quant = name.partition("+")
    spec = {"method": name, "num_speculative_tokens": int(k) if k else args.k}
    if name == "ngram":
        spec.update(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
    elif name == "draft_model":
        spec["model"] = args.draft
        if quant:
            spec["quantization"] = quant
    elif name == "layer_skip":
        spec["draft_layers"] = args.draft_layers
    return spec


def speculators(llm: LLM, args) -> dict:
    """One target, each method's speculator on it in turn (``None``: drafts off): the sides
    share the target's weights, so a 1.5B target is in memory once."""
    from kvserve.config import SpeculativeConfig
    from kvserve.models import loader
    eng = llm.engine
    src = loader.resolve(args.model)
    out = {"off": None}
    for name in args.methods:
        out[name] = eng._speculator(SpeculativeConfig.from_dict(method_config(name, args)), src)
        # Each verify step's (drafts, accepted), for the per-draft acceptance rate replayed on the GPU.
        st = out[name].stats
        st.log, record = [], st.record
        st.record = lambda n, a, st=st, record=record: (st.log.append((n, a)), record(n, a))
        # Every decode step in order, (drafts proposed, drafts kept), (0, 0) where none were
        # proposed: what ``--replay`` plays back step by step. Not the step that samples a
        # request's first token (its prompt's last, even when the rest was cached).
        sp = out[name]
        sp.trace, observe = [], sp.observe

        def traced(o, result, launched, sp=sp, observe=observe):
            for s, toks in zip(o.scheduled, result.sampled_token_ids):
                if (toks and s.num_new_tokens == len(s.draft_token_ids) + 1
                        and s.request.num_output_tokens > len(toks)):
                    sp.trace.append((len(s.draft_token_ids), len(toks) - 1))
            observe(o, result, launched)
        sp.observe = traced
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def position_rates(log: list[tuple[int, int]], k: int) -> dict:
    """Per draft position j (from 0): how often draft j was proposed, reached (the j drafts
    before it accepted) and accepted. ``rate``: accepted / reached, the chance draft j is kept
    once the ones before it are (what ``--replay`` draws with)."""
    proposed, reached, accepted = [0] * k, [0] * k, [0] * k
    for n, a in log:
        for j in range(n):
            proposed[j] += 1
            reached[j] += j <= a
            accepted[j] += j < a
    return {"proposed": proposed, "reached": reached, "accepted": accepted,
            "rate": [a / r if r else None for a, r in zip(accepted, reached)]}


def batch1(args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.model, show_progress=False, kv_cache_memory="512MiB",
              speculative_config=method_config("ngram", args))  # an engine set up for drafts
    load = {"target_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    sides = speculators(llm, args)
    load["speculators_s"] = time.perf_counter() - t0
    print(f"load: target {load['target_s']:.1f} s, speculators {load['speculators_s']:.1f} s", flush=True)
    out = {"load": load}
    if args.step_costs:
        out["step_costs"] = step_costs(llm, sides, args)
    for name in args.workloads:
        texts = WORKLOADS[name]
        prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts[:args.prompts]]
        best = dict.fromkeys(sides, float("inf"))
        times: dict[str, list[float]] = {side: [] for side in sides}
        tokens = {}
        for sp in sides.values():
            if sp is not None:
                sp.stats.log.clear()
        for _ in range(args.repeats):  # the sides alternate, so load from other jobs falls on each
            for side, sp in sides.items():
                llm.engine.speculator = sp
                if sp is not None:
                    sp.trace.clear()
                toks, dt = run_side(llm, prompts, args.max_tokens)
                tokens[side] = toks
                best[side] = min(best[side], dt)
                times[side].append(dt)
        n = sum(map(len, tokens["off"]))
        # Decode steps of the target with drafts off (each prompt's first token is its prefill's).
        decode = n - len(prompts)
        row = {"tokens": n, "off_tok_s": n / best["off"], "loadavg": os.getloadavg(), "times_s": times,
               "off_decode_steps": decode}
        line = f"{name:8s} {n:5d} tokens | off {row['off_tok_s']:6.2f} tok/s"
        for side, sp in sides.items():
            if sp is None:
                continue
            # Greedy: the same tokens either way, exactly in float32. bfloat16 logits are rounded to
            # 8 bits (steps of 0.125 from 16 to 32): where the top two are one step apart, a verify
            # step of several rows, summed in another order, can rank them the other way. There
            # the prompts' shared leading tokens are recorded instead.
            same = [_common_prefix(a, b) for a, b in zip(tokens[side], tokens["off"])]
            if llm.engine.runner.dtype == torch.float32:
                assert tokens[side] == tokens["off"], side
            log = sp.stats.log
            steps, acc = len(log), sum(a for _, a in log)
            checked = sum(a + (a < d) for d, a in log)  # accepted drafts and the first rejected one
            # Each side's own tokens: after a bfloat16 tie its answers can differ in length.
            n_side = sum(map(len, tokens[side]))
            row[side] = {"tok_s": n_side / best[side], "speedup": n_side / best[side] / row["off_tok_s"],
                         "tokens": n_side,
                         "mean_acceptance_length": 1 + acc / steps if steps else 0.0,
                         "draft_acceptance_rate": acc / checked if checked else 0.0,
                         "steps": steps,
                         # Each accepted draft saves one target step: the speedup if a verify step
                         # cost a 1-token step and drafting were free, free of the machine's load.
                         "target_steps": decode - acc / args.repeats,
                         "step_bound_speedup": decode / (decode - acc / args.repeats),
                         "per_position": position_rates(log, sp.config.num_speculative_tokens),
                         "same_leading_tokens": same, "off_tokens": [len(t) for t in tokens["off"]],
                         "trace": list(sp.trace)}
            r = row[side]
            line += (f" | {side} {r['tok_s']:6.2f} tok/s {r['speedup']:.2f}x, acceptance length "
                     f"{r['mean_acceptance_length']:.2f}, {sum(same)} of {n} tokens as off")
        out[name] = row
        print(line, flush=True)
    llm.engine.speculator = None
    return out


@torch.inference_mode()
def step_costs(llm: LLM, sides: dict, args) -> dict:
    """Batch 1 on this machine: the target's step of ``q`` tokens (a verify step of ``q - 1``
    drafts, with every position's logits) against its 1-token step, and each draft model's
    1-token step, at ``--context`` tokens of context. The shapes run in turn, ``--iters``
    rounds, so load from other jobs falls on all of them; each keeps its median and its best."""
    rt = llm.engine.runner
    per = -(-(args.context + args.k + 1) // llm.engine.block_size)
    if per > llm.engine.num_kv_blocks:
        raise SystemExit(f"the KV pool holds {llm.engine.num_kv_blocks} blocks; lower --context")
    table = list(range(per))
    steps = {f"target_q{q}": (lambda q=q: rt._logits(rt._forward([1] * q, [(args.context, q, table)])[0]))
             for q in range(1, args.k + 2)}
    for side, sp in sides.items():
        if sp is not None and sp.draft is not None:
            steps[f"{side}_q1"] = lambda d=sp.draft: d._forward([1], [(args.context, 1, table)])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for fn in steps.values():
        fn()  # warm-up: first calls at a shape pay for allocation
    for _ in range(args.iters):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base = med["target_q1"]
    out = {"context": args.context, "iters": args.iters, "loadavg": os.getloadavg(),
           "ms": {name: {"median": med[name] * 1e3, "best": min(t) * 1e3} for name, t in times.items()},
           "over_target_1_token": {name: med[name] / base for name in steps}}
    print("step costs (median ms, / the target's 1-token step): " + ", ".join(
        f"{name} {med[name] * 1e3:.0f} ({med[name] / base:.2f})" for name in steps), flush=True)
    return out


def replay(args) -> dict:
    """End to end at each batch size with drafts accepted as measured (synthetic acceptance, as
    vLLM's benchmarks do): each request plays the batch-1 run's trace, proposing and keeping
    at each decode step what that step did, then emits the target's token (without a trace:
    draws by the per-position rates, see the module's docstring). Drafts cost what they cost:
    the draft model runs, the n-gram lookup runs. Output tokens are not the model's; only the
    time is measured."""
    from kvserve.engine.spec import ngram, rejection, speculator
    with open(args.replay) as f:
        measured = json.load(f)["batch1"]
    measured = {w: row for w, row in measured.items() if w in WORKLOADS}  # not "load", "step_costs"
    gen = torch.Generator().manual_seed(0)
    state = {"a": [0.0], "lengths": [], "trace": None, "cursors": {}}

    def synthetic_accept(drafts, best):
        if state["trace"]:  # the drafts carry how many of them the traced step kept
            m = min(drafts[0] - TRACE_TOKEN, len(drafts))
            return drafts[:m] + [best[m]]
        a, m = state["a"], 0
        while m < len(drafts) and float(torch.rand(1, generator=gen)) < a[min(m, len(a) - 1)]:
            m += 1
        return drafts[:m] + [best[m]]

    def rates(r: dict) -> list[float]:
        """Draft j's acceptance rate given the ones before it were kept; a position the batch-1
        run never reached takes the method's overall per-draft rate."""
        per = r.get("per_position", {}).get("rate") or []
        return [x if x is not None else r["draft_acceptance_rate"] for x in per] or [r["draft_acceptance_rate"]]

    def lengths(r: dict, decode_steps: int) -> list[float]:
        """P(the lookup proposes at least j + 1 drafts) over every decode step of the batch-1
        run, the steps where it found no match included (those ran as plain steps)."""
        proposed = r.get("per_position", {}).get("proposed") or []
        accepted = sum(r.get("per_position", {}).get("accepted") or [])
        steps = decode_steps - accepted  # the target's decode steps with drafts on
        return [p / steps for p in proposed] if proposed and steps > 0 else []

    def traced(tokens, k):
        """The next traced step's drafts for the request of ``tokens``: each request plays the
        trace from its own place (a batch's requests spread over it), a step per step it decodes."""
        trace, cursor = state["trace"], state["cursors"]
        i = cursor.setdefault(id(tokens), len(cursor) * 997 % len(trace))
        cursor[id(tokens)] = (i + 1) % len(trace)
        n, kept = trace[i]
        return [TRACE_TOKEN + kept] * min(n, k)

    def synthetic_ngram(tokens, k, lo, hi):
        ngram.propose_ngram(tokens, k, lo, hi)  # the lookup's host cost is paid; its match is not used
        if state["trace"]:
            return traced(tokens, k)
        u, at_least = float(torch.rand(1, generator=gen)), state["lengths"]
        n = sum(u < p for p in at_least) if at_least else k
        return [int(tokens[-1])] * min(n, k)

    def set_side(side, sp, row):
        state["trace"] = row[side].get("trace") if sp is not None and not args.replay_rates else None
        state["cursors"] = {}
        state["a"] = rates(row[side]) if sp is not None else [0.0]
        state["lengths"] = lengths(row[side], row["off_decode_steps"]) if sp is not None else []
        llm.engine.speculator = sp

    rejection.accept_greedy = synthetic_accept  # every greedy verification ends here
    speculator.propose_ngram = synthetic_ngram
    B_max = max(args.batches)
    # A fixed pool: the speculators built below allocate their drafts' KV beside the target's, so
    # the target must not take the device's free memory as it does by default.
    kv = args.kv_cache_memory or ("24GiB" if torch.cuda.is_available() else "256MiB")
    llm = LLM(args.model, show_progress=False, max_num_seqs=B_max, kv_cache_memory=kv,
              max_model_len=args.context + args.max_tokens + 32,
              max_num_batched_tokens=max(2048, B_max * (args.k + 1)), cuda_graph_max_batch=args.graph_rows,
              speculative_config=method_config("ngram", args))
    sides = speculators(llm, args)
    for sp in sides.values():
        if sp is not None and sp.draft is not None:  # the draft model runs; the trace says what it keeps
            def propose(want, running, real=sp.draft.propose):
                if not state["trace"]:
                    return real(want, running)
                drafts = [traced(r.all_token_ids, k) for r, k in want]  # as many steps as traced
                real([(r, len(d)) for (r, _), d in zip(want, drafts) if d], running)
                for (r, _), d in zip(want, drafts):
                    r.spec_token_ids = d if r.spec_token_ids or not d else []  # [] where the pool said no
            sp.draft.propose = propose
    if args.draft_steps == "rule":  # the batch rule alone, without the measured choice
        for sp in sides.values():
            if sp is not None:
                sp.choice.drafts = lambda n: True
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    out = {"draft_steps": args.draft_steps}
    for w, row in measured.items():
        run = {side: sp for side, sp in sides.items() if sp is None or side in row}  # methods the run measured
        for B in args.batches:
            prompts = [[(7 * i + j) % 30000 + 100 for j in range(args.context)] for i in range(B)]
            best = dict.fromkeys(sides, float("inf"))
            verify_steps, accepted = dict.fromkeys(sides, 0), dict.fromkeys(sides, 0)
            # Warm-up, untimed: each side once at this batch size, so kernels compiled for its
            # shapes (a draft model's catch-up of a batch of prompts: a second or more each) are
            # not in the timed runs; the choice between drafted and plain steps starts from it.
            for side, sp in run.items():
                set_side(side, sp, row)
                llm.generate(prompts, SamplingParams(max_tokens=min(64, args.max_tokens), temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
            for _ in range(args.repeats):
                for side, sp in run.items():
                    set_side(side, sp, row)
                    st0 = sp.stats.copy() if sp is not None else None
                    t0 = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    best[side] = min(best[side], time.perf_counter() - t0)
                    if sp is not None:  # the last run's verify steps and accepted drafts
                        verify_steps[side] = sp.stats.spec_decode_num_drafts - st0.spec_decode_num_drafts
                        accepted[side] = (sp.stats.spec_decode_num_accepted_tokens
                                          - st0.spec_decode_num_accepted_tokens)
            n = B * args.max_tokens
            res = {"off_tok_s": n / best["off"]}
            line = f"{w:8s} batch {B:4d}: off {res['off_tok_s']:8.1f} tok/s"
            for side in run:
                if side == "off":
                    continue
                a = row[side]["draft_acceptance_rate"]
                v = verify_steps[side]
                res[side] = {"rate": a, "rates": rates(row[side]), "tok_s": n / best[side],
                             "speedup": best["off"] / best[side], "requests_with_drafts": v,
                             "replayed_acceptance_length": 1 + accepted[side] / v if v else 0.0,
                             "measured_acceptance_length": row[side]["mean_acceptance_length"],
                             "traced": bool(row[side].get("trace")) and not args.replay_rates}
                line += (f" | {side} a={a:.2f} {res[side]['tok_s']:8.1f} tok/s {res[side]['speedup']:.2f}x"
                         f" ({v} drafted, acceptance length {res[side]['replayed_acceptance_length']:.2f},"
                         f" measured {row[side]['mean_acceptance_length']:.2f})")
            out[f"{w}/{B}"] = res
            print(line + " (synthetic acceptance)", flush=True)
    llm.engine.speculator = None
    # Each method's measured seconds per emitted token, drafted and plain, per batch-size bucket
    # (what decided whether its steps drafted).
    out["step_costs_per_token"] = {side: {f"batch<{2 ** b}/{'drafted' if d else 'plain'}": c
                                          for (b, d), c in sp.choice.costs().items()}
                                   for side, sp in sides.items() if sp is not None}
    print(json.dumps(out["step_costs_per_token"], indent=1), flush=True)
    return out


@torch.inference_mode()
def verify_cost(args) -> dict:
    llm = LLM(args.model, show_progress=False, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(args.batches) * 9, max_model_len=args.context + 16,
              cuda_graph_max_batch=args.graph_rows,  # speculation on: graphs for verify rows too
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    rt = llm.engine.runner
    bs = llm.engine.block_size
    per = -(-(args.context + 9) // bs)
    if per * max(args.batches) > llm.engine.num_kv_blocks:
        raise SystemExit(f"the KV pool holds {llm.engine.num_kv_blocks} blocks; lower --context")
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)

    def step_time(B: int, q: int, rows: bool | None = None) -> float:
        seqs = [(args.context, q, list(range(i * per, (i + 1) * per))) for i in range(B)]
        ids = [1] * (B * q)
        best = float("inf")
        rt._forward(ids, seqs, rows=rows)  # warm-up: first calls at a shape pay for allocation and tuning
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            hidden, _ = rt._forward(ids, seqs, rows=rows)
            rt._logits(hidden)  # every position's logits: what verification reads
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def path(B: int, q: int) -> str:
        """Whether the engine replays a graph for the step (``ModelRunner._forward``'s rule)."""
        g = rt.graphs
        rows = q == 1 or (rt.config.kernel.decode_rows != "never" and not rt.kv_format.kivi
                          and decode_rows.eligible([(args.context, q, [])]))
        return "graph" if g is not None and rows and g.fits(B * q, per, q > 1) else "eager"

    out = {}
    for B in args.batches:
        base = step_time(B, 1)
        row = {"decode_ms": base * 1e3, "decode_path": path(B, 1)}
        for k in range(1, 9):
            row[f"k{k}"] = step_time(B, k + 1) / base
            row[f"k{k}_path"] = path(B, k + 1)
            row[f"k{k}_prefill_shaped"] = step_time(B, k + 1, rows=False) / base
        out[str(B)] = row
        print(f"batch {B:4d}: 1-token step {base * 1e3:7.2f} ms ({row['decode_path']}) | verify/decode time, "
              "k=1..8: " + " ".join(f"{row[f'k{k}']:.2f}{'g' if row[f'k{k}_path'] == 'graph' else 'e'}"
                                    for k in range(1, 9))
              + " | prefill-shaped: " + " ".join(f"{row[f'k{k}_prefill_shaped']:.2f}" for k in range(1, 9)),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["ngram"],
                    help="batch 1: methods against drafts off, of ngram, draft_model, layer_skip; "
                    "method:k for its own num_speculative_tokens")
    ap.add_argument("--draft", default=None, help="draft_model's model (GGUF file, HF directory, dummy:<preset>)")
    ap.add_argument("--draft-layers", type=int, default=None, help="layer_skip's draft_layers")
    ap.add_argument("--prompts", type=int, default=4, help="batch 1: prompts per workload")
    ap.add_argument("--replay", default=None, metavar="JSON",
                    help="end to end at --batches, replaying the steps of a batch-1 run's JSON")
    ap.add_argument("--replay-rates", action="store_true",
                    help="--replay: draw acceptance by the per-position rates even where a trace is kept")
    ap.add_argument("--draft-steps", choices=("measured", "rule"), default="measured",
                    help="--replay: whether a step drafts is measured as it runs (the engine's way), or "
                         "decided by the batch rule alone")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    ap.add_argument("--context", type=int, default=512, help="--verify-cost: tokens already in each sequence")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-cache-memory", default=None, help="--replay: the target's KV pool (default 24GiB on "
                    "CUDA, 256MiB on the CPU; each draft's pool has as many blocks)")
    ap.add_argument("--graph-rows", type=int, default=512,
                    help="--verify-cost: the most rows a decode CUDA graph holds (cuda_graph_max_batch)")
    ap.add_argument("--workloads", type=lambda s: [w for w in s.split(",") if w], default=list(WORKLOADS),
                    help=f"batch 1: of {', '.join(WORKLOADS)} ('': none, e.g. with --step-costs alone)")
    ap.add_argument("--lookup-min", type=int, default=2, help="ngram's prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=5, help="ngram's prompt_lookup_max")
    ap.add_argument("--step-costs", action="store_true",
                    help="batch 1: first time a verify step against a 1-token step, and each draft's step")
    ap.add_argument("--out", default=None, help="directory for the JSON")
    ap.add_argument("--name", default="speculative.json", help="the JSON's file name in --out")
    args = ap.parse_args()
    if unknown := set(args.workloads) - set(WORKLOADS):
        ap.error(f"--workloads: unknown {sorted(unknown)}; of {', '.join(WORKLOADS)}")
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "model": args.model or "default", "args": {k: v for k, v in vars(args).items() if k != "out"}}
    if args.verify_cost:
        res["verify_cost"] = verify_cost(args)
    elif args.replay:
        res["replay"] = replay(args)
    else:
        res["batch1"] = batch1(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
