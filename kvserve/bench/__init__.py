"""`kvserve bench serve`: a load generator for any OpenAI-compatible server.

    datasets.py  what to send (random lengths, multi-turn chat)     client.py  one streamed request, timed
    serve.py     config, arrivals (concurrency / Poisson), sweep     report.py  percentiles, goodput, table, JSON
    plots.py     PNG: latency CDFs, throughput and p99 TTFT against request rate
"""
