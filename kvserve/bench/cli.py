"""The ``kvserve bench`` subcommands: load-test a server, compare results."""
from __future__ import annotations

import sys


def cmd_bench_serve(args) -> int:
    from kvserve.bench.serve import main as bench_main
    try:
        return bench_main(args)
    except (ValueError, ImportError) as e:  # BenchConfig validation, matplotlib missing
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


def cmd_bench_compare(args) -> int:
    import json
    import os

    from kvserve.bench import html_report, report
    results = {}
    for path in args.results:
        label = os.path.basename(path)
        if label in results:
            label = path
        try:
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
            if not isinstance(res, dict) or not isinstance(res.get("runs"), list):
                raise ValueError("no 'runs' list: not a `kvserve bench serve --json-out` result")
        except (OSError, ValueError) as e:
            print(f"kvserve: error: {path}: {e}", file=sys.stderr)
            return 2
        results[label] = res
    for label, res in results.items():
        print(f"{label}\n{report.table(res['runs'])}\n")
    if args.report:
        try:
            page = html_report.compare_page(results)
        except ImportError as e:
            print(f"kvserve: error: {e}", file=sys.stderr)
            return 2
        html_report.write(args.report, page)
        print(f"wrote {args.report}")
    return 0


def add_bench_args(sub) -> None:
    """``kvserve bench serve`` and ``kvserve bench compare`` under ``sub``."""
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    s = b.add_parser("serve", help="load-test an OpenAI-compatible server (kvserve or any peer)")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    s.add_argument("--model", required=True, help="the model name the server expects")
    s.add_argument("--api-key", default=None)
    s.add_argument("--dataset", default="random", choices=["random", "multiturn"])
    s.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="for the random dataset (multiturn always uses chat)")
    s.add_argument("--num-requests", type=int, default=100, help="requests (turns, for multiturn) per pass")
    s.add_argument("--concurrency", type=int, default=None, help="at most this many sessions in flight")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once)")
    s.add_argument("--request-rates", default=None, help="sweep: comma-separated rates, one pass each")
    s.add_argument("--input-len-min", type=int, default=128, help="prompt words/ids ~ U[min, max]")
    s.add_argument("--input-len-max", type=int, default=512)
    s.add_argument("--output-len-min", type=int, default=64, help="output tokens ~ U[min, max] (exact with ignore_eos)")
    s.add_argument("--output-len-max", type=int, default=256)
    s.add_argument("--prompt-format", default="words", choices=["words", "token-ids"],
                   help="token-ids: random ids in [--token-id-min, --token-id-max), for models without a tokenizer")
    s.add_argument("--token-id-min", type=int, default=1)
    s.add_argument("--token-id-max", type=int, default=500)
    s.add_argument("--num-turns", type=int, default=3, help="multiturn: user turns per conversation")
    s.add_argument("--system-prompt-len", type=int, default=256, help="multiturn: words in the shared system prompt")
    s.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (a server that refuses it)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--json-out", default=None)
    s.add_argument("--plot-dir", default=None)
    s.add_argument("--report", default=None, metavar="HTML",
                   help="write one self-contained HTML page with the plots and the table")
    s.set_defaults(func=cmd_bench_serve)
    c = b.add_parser("compare", help="compare `bench serve --json-out` results on one page")
    c.add_argument("results", nargs="+", metavar="JSON", help="result files, labelled by their file names")
    c.add_argument("--report", default=None, metavar="HTML", help="write the comparison as one HTML page")
    c.set_defaults(func=cmd_bench_compare)
