"""kvserve on Ray Serve: engine replicas behind one OpenAI-compatible front end, with a router that
sends each request where its prefix is cached (``kvserve serve --replicas N``).

    client ─► Ray's HTTP proxy ─► Ingress (route key: block hashes, session) ─► CacheAwareRouter
          ─► EngineReplica (the single-process app, unchanged, over its own engine) ─► stream back

Only this package imports Ray, and only ``kvserve serve --replicas`` imports this package: the
single-process server runs without Ray installed. ``prefix_index`` is pure bookkeeping (no Ray).
"""
