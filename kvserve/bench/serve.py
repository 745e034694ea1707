"""`kvserve bench serve`: drive an OpenAI-compatible server (kvserve or a peer) and report.

Load: sessions start at Poisson arrivals of `request_rate` per second (inf: all at once), and at
most `concurrency` sessions are in flight (None: no cap). So `--concurrency N` alone is a closed
loop of N clients, `--request-rate R` alone an open loop; both together cap an open loop. A
session of the multiturn dataset sends its turns one after another, so its rate counts sessions.
`request_rates` runs one pass per rate (same requests each time) and adds the sweep plot.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from kvserve.bench import datasets, html_report, plots, report
from kvserve.bench.client import RequestResult, send


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    dataset: str = "random"  # random | multiturn
    endpoint: str = "completions"  # random dataset: completions | chat (multiturn is always chat)
    num_requests: int = 100
    concurrency: int | None = None
    request_rate: float = math.inf
    request_rates: tuple[float, ...] = ()
    input_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (64, 256)
    prompt_format: str = "words"  # words | token-ids
    token_id_range: tuple[int, int] = (1, 500)
    num_turns: int = 3
    system_prompt_len: int = 256
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self):
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"bench serve: {what}")
        need(self.dataset in ("random", "multiturn"), f"dataset must be random or multiturn, got {self.dataset!r}")
        need(self.endpoint in ("completions", "chat"), f"endpoint must be completions or chat, got {self.endpoint!r}")
        need(self.prompt_format in ("words", "token-ids"),
             f"prompt_format: words or token-ids, got {self.prompt_format!r}")
        need(not (self.prompt_format == "token-ids" and (self.endpoint == "chat" or self.dataset == "multiturn")),
             "token-ids prompts need the completions endpoint and the random dataset")
        need(self.num_requests >= 1, f"num_requests must be >= 1, got {self.num_requests}")
        need(self.concurrency is None or self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}")
        for r in (self.request_rate, *self.request_rates):
            need(r > 0, f"request rates must be > 0 (inf: all at once), got {r}")
        for name in ("input_len", "output_len", "token_id_range"):
            lo, hi = getattr(self, name)
            need(1 <= lo <= hi, f"{name} must satisfy 1 <= min <= max, got {lo}..{hi}")
        need(self.num_turns >= 1 and self.system_prompt_len >= 0, "num_turns >= 1, system_prompt_len >= 0")
        need(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def rates(self) -> tuple[float, ...]:
        return self.request_rates or (self.request_rate,)

    def sessions(self) -> list[datasets.Session]:
        if self.dataset == "multiturn":
            return datasets.multiturn_sessions(self.num_requests, self.num_turns, self.system_prompt_len,
                                               self.input_len, self.output_len, self.seed)
        return datasets.random_sessions(self.num_requests, self.input_len, self.output_len, self.prompt_format,
                                        self.token_id_range, self.seed)


def _body(cfg: BenchConfig, turn: datasets.Turn, messages: list[dict] | None) -> dict:
    body = {"model": cfg.model, "max_tokens": turn.output_len, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM/kvserve extra: outputs of exactly max_tokens tokens
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = turn.prompt
    return body


async def _session(cfg: BenchConfig, client: httpx.AsyncClient, s: datasets.Session) -> list[RequestResult]:
    chat = cfg.dataset == "multiturn" or cfg.endpoint == "chat"
    path = "chat/completions" if chat else "completions"
    history = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
    results = []
    for turn in s.turns:
        messages = None
        if chat:
            history.append({"role": "user", "content": turn.user_message or turn.prompt})
            messages = list(history)
        r = await send(client, path, _body(cfg, turn, messages), RequestResult(turn.input_len, turn.output_len))
        results.append(r)
        if not r.ok:
            break  # the rest of the conversation would build on a reply that never came
        if chat:
            history.append({"role": "assistant", "content": r.text})
    return results


async def _kv_usage(client: httpx.AsyncClient, url: str, t0: float, out: list, interval_s: float = 0.5) -> None:
    """Sample the server's KV blocks in use from its Prometheus /metrics while the pass runs, as
    [seconds since start, used, free]; a server that does not export kvserve's gauges records nothing."""
    from prometheus_client.parser import text_string_to_metric_families
    while True:
        try:
            r = await client.get(url)
            r.raise_for_status()
            got = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
            out.append([time.perf_counter() - t0, got["kvserve_kv_blocks_used"], got["kvserve_kv_blocks_free"]])
        except (httpx.HTTPError, KeyError, ValueError):
            return
        await asyncio.sleep(interval_s)


async def run_once(cfg: BenchConfig, rate: float) -> tuple[list[RequestResult], float, list]:
    """One pass over the dataset at `rate`; (results, wall seconds from first send to last reply,
    KV usage samples: see _kv_usage)."""
    sessions, rng = cfg.sessions(), random.Random(cfg.seed + 1)
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/") + "/", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        async def one(s):
            if gate is None:
                return await _session(cfg, client, s)
            async with gate:
                return await _session(cfg, client, s)

        t0, tasks, kv = time.perf_counter(), [], []
        root = cfg.base_url.rstrip("/").removesuffix("/v1")
        sampler = asyncio.create_task(_kv_usage(client, root + "/metrics", t0, kv))
        for s in sessions:
            tasks.append(asyncio.create_task(one(s)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return [r for rs in done for r in rs], duration, kv


def _load_label(cfg: BenchConfig, rate: float) -> str:
    parts = [] if math.isinf(rate) else [f"rate {rate:g}/s"]
    if cfg.concurrency:
        parts.append(f"conc {cfg.concurrency}")
    return ", ".join(parts) or "all at once"


def run(cfg: BenchConfig) -> dict:
    """Every pass, summarized: {"config", "runs": [{"load", "request_rate", "concurrency", "summary",
    "samples_ms", "kv_usage", "requests"}]}."""
    runs = []
    for rate in cfg.rates:
        results, duration, kv = asyncio.run(run_once(cfg, rate))
        ok = [r for r in results if r.ok]
        runs.append({"load": _load_label(cfg, rate), "request_rate": None if math.isinf(rate) else rate,
                     "concurrency": cfg.concurrency,
                     "summary": report.summarize(results, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms),
                     "samples_ms": {"ttft": [r.ttft * 1e3 for r in ok], "tpot": [r.tpot * 1e3 for r in ok if r.tpot],
                                    "itl": [x * 1e3 for r in ok for x in r.itl]},
                     "kv_usage": kv or None, "requests": [r.as_dict() for r in results]})
    conf = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(cfg).items()}
    conf.pop("api_key")
    return {"config": conf, "runs": runs}


def main(args) -> int:
    rates = tuple(float(x) for x in args.request_rates.split(",")) if args.request_rates else ()
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, dataset=args.dataset, endpoint=args.endpoint,
        num_requests=args.num_requests, concurrency=args.concurrency, request_rate=args.request_rate,
        request_rates=rates, input_len=(args.input_len_min, args.input_len_max),
        output_len=(args.output_len_min, args.output_len_max), prompt_format=args.prompt_format,
        token_id_range=(args.token_id_min, args.token_id_max), num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len, ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature, seed=args.seed, api_key=args.api_key, timeout_s=args.timeout,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    if args.plot_dir or args.report:
        plots._pyplot()  # no matplotlib: say so before the run, not after it
    out = run(cfg)
    print(report.table(out["runs"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json_out}")
    if args.plot_dir:
        for p in plots.write_all(out["runs"], list(rates) or None, args.plot_dir):
            print(f"wrote {p}")
    if args.report:
        html_report.write(args.report, html_report.serve_page(out))
        print(f"wrote {args.report}")
    failed = sum(r["summary"]["failed"] for r in out["runs"])
    if failed:
        print(f"{failed} requests failed; first errors: {out['runs'][0]['summary']['errors'][:3]}", file=sys.stderr)
    return 1 if failed else 0
