"""Quality of a configuration on a real model: perplexity over a text, and greedy agreement
with a reference run (for lossy options such as a compressed KV cache)."""
from __future__ import annotations

import math

from kvserve.sampling_params import SamplingParams


def heldout_ids(tok, n: int) -> list[int]:
    """The first ``n`` tokens of Python's reference documentation (``pydoc_data.topics``, shipped
    with Python), the benchmarks' held-out text."""
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tok.encode(text)[:n]


def token_nll(llm, token_ids: list[int], kv_budget: int | None = None) -> list[float]:
    """The negative log-likelihood of each of ``token_ids[1:]``, each token given all before it
    (as much of it as ``kv_budget`` leaves held), through the engine: the text is one sequence,
    prefilled in chunks of the engine's ``max_num_batched_tokens``, so every chunk after the
    first attends to the KV cache as stored (compressed, if the cache is)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, kv_budget=kv_budget)
    out = llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0]
    lps = [p for p in out.prompt_logprobs if p is not None]
    if len(lps) != len(token_ids) - 1:
        raise RuntimeError(f"got {len(lps)} prompt log-probs for {len(token_ids)} tokens")
    return [-p[t].logprob for p, t in zip(lps, token_ids[1:])]  # {id: Logprob} per position


def recomputed_nll(llm, ids: list[int], budget: int, stride: int, bos_token_id: int | None) -> list[float]:
    """``token_nll``'s list with each token given only about ``budget`` tokens before it, their
    KV recomputed (the StreamingLLM paper's sliding window with re-computation, its reference):
    the tokens before ``budget + stride // 2`` see all the text before them; after them, each
    window ``ids[a:end]`` scores its last ``stride`` tokens, which see from ``budget - stride //
    2`` to ``budget + stride // 2 - 1`` tokens before them (``budget`` on average) at positions
    from 0. A text that opens with ``bos_token_id`` has it put before every window too, as a
    fresh document would."""
    if not 1 <= stride <= budget or isinstance(stride, bool) or isinstance(budget, bool):
        raise ValueError(f"stride must lie in [1, budget = {budget}], got {stride!r}")
    bos = ids[:1] if ids and bos_token_id is not None and ids[0] == bos_token_id else []
    reach = budget - stride // 2  # the context of each later window's first scored token
    jobs = [(0, 1, min(len(ids), budget + stride // 2))]
    while jobs[-1][2] < len(ids):
        first = jobs[-1][2]
        jobs.append((first - reach, first, min(len(ids), first + stride)))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": (bos if a else []) + ids[a:end]} for a, _, end in jobs], params,
                        use_tqdm=False)
    nll = []
    for (a, first, end), out in zip(jobs, outs):
        lps = out.prompt_logprobs  # one per prompt position, None at the first
        shift = len(bos) if a else 0
        nll += [-lps[t - a + shift][ids[t]].logprob for t in range(first, end)]
    if len(nll) != len(ids) - 1:
        raise RuntimeError(f"scored {len(nll)} of {len(ids) - 1} tokens")
    return nll


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` (``token_nll``)."""
    nll = token_nll(llm, token_ids)
    return math.exp(sum(nll) / len(nll))


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two sets of continuations hold the same token."""
    same = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        same += sum(1 for i in range(min(len(x), len(y))) if x[i] == y[i])
        total += n
    return same / max(1, total)


def teacher_forced_agreement(llm, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Fraction of positions where ``llm``'s greedy choice equals the reference's, each given
    the reference's own history (prompt + reference continuation so far): per-step agreement,
    without the cascade that makes free-running continuations part ways for good after one
    near-tie. Read from prompt log-probs: the reference token must rank first."""
    reqs = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompts, continuations)]
    outs = llm.generate(reqs, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    same = total = 0
    for p, c, o in zip(prompts, continuations, outs):
        ids = list(p) + list(c)
        for j in range(len(p), len(ids)):
            same += o.prompt_logprobs[j][ids[j]].rank == 1
            total += 1
    return same / max(1, total)
