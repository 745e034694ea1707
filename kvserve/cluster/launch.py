"""`kvserve serve --replicas N`: the Ray Serve application, and running it until a signal.

    ray.init (local, or --ray-address)  ─►  serve.start(HTTP on --host:--port)
        ─►  serve.run(Ingress ─► EngineReplica x N, routed by CacheAwareRouter)  ─►  wait
    SIGTERM/SIGINT: the application is deleted (replicas drain for --shutdown-timeout); a local
    Ray instance started here is stopped, a cluster joined with --ray-address is left running.

With --min-replicas/--max-replicas Ray Serve's autoscaler sizes the deployment by ongoing
requests per replica (--target-ongoing-requests); at zero replicas a request waits in the
ingress's handle until the first replica is up.
"""
from __future__ import annotations

import os
import signal
import threading

from kvserve.config import parse_size
from kvserve.errors import ConfigError
from kvserve.kv_format import default_block_size

APP_NAME = "kvserve"
ROUTERS = {  # --router: how requests pick a replica (Ray's own two, registered for /health and /metrics)
    "cache-aware": "kvserve.cluster.router:CacheAwareRouter",
    "power-of-two": "kvserve.cluster.router:PowerOfTwo",
    "round-robin": "kvserve.cluster.router:RoundRobin",
}
LOOK_BACK_S = 30.0  # Ray Serve's default look-back window for the load average


def _scaling(args) -> dict:
    """A fixed --replicas, or Ray Serve's autoscaler between --min- and --max-replicas (starting at
    --replicas if given, else at the minimum)."""
    if args.max_replicas is None:
        return {"num_replicas": args.replicas or 1}
    if not 0 <= args.min_replicas <= args.max_replicas:
        raise ConfigError("min_replicas", f"must be in [0, --max-replicas = {args.max_replicas}], "
                          f"got {args.min_replicas}")
    if args.replicas is not None and not args.min_replicas <= args.replicas <= args.max_replicas:
        raise ConfigError("replicas", f"with autoscaling, must be in [{args.min_replicas}, {args.max_replicas}], "
                          f"got {args.replicas}")
    if not args.target_ongoing_requests > 0:
        raise ConfigError("target_ongoing_requests", f"must be > 0, got {args.target_ongoing_requests}")
    if not 0 <= args.scale_down_delay < float("inf"):
        raise ConfigError("scale_down_delay", f"must be a number of seconds >= 0, got {args.scale_down_delay}")
    # Ray averages the load over a look-back window (30 s) before the delay even starts: a replica
    # idle for --scale-down-delay seconds would wait for the window too. Shorter delays shorten it.
    auto = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests, "downscale_delay_s": args.scale_down_delay,
            "look_back_period_s": min(LOOK_BACK_S, max(1.0, args.scale_down_delay))}
    if args.replicas is not None:
        auto["initial_replicas"] = args.replicas
    return {"autoscaling_config": auto}


# Ray's router passes over a replica that has not answered its queue-length probe within 0.1 s and
# takes the next-ranked one, which throws the cache-aware ranking away. A kvserve replica answers
# from an asyncio loop that shares the GIL with its engine thread, so on a busy CPU it is often
# that slow. The router lives in the ingress's process: it waits 1 s (5 s after backoff) unless
# the environment says otherwise.
PROBE_DEADLINES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1",
                   "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5"}


def application(args, make_engine, router: str = "cache-aware"):
    """The bound Serve application (Ingress over the replica deployment) for `kvserve serve`'s args."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvserve.cluster.ingress import Ingress
    from kvserve.cluster.replica import EngineReplica
    from kvserve.models import loader
    from kvserve.server.launcher import app_kwargs

    block_size = args.block_size or default_block_size(args.kv_cache_dtype)  # the router's, as the engine's
    scaling = _scaling(args)
    replicas = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        ray_actor_options={"num_cpus": args.cpus_per_replica, "num_gpus": args.gpus_per_replica},
        # the engine batches continuously; the app itself answers 429 past --max-waiting
        max_ongoing_requests=args.max_num_seqs + args.max_waiting,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_router_kwargs={"block_size": block_size},
                                                  request_routing_stats_period_s=1.0),
        health_check_period_s=2.0, graceful_shutdown_timeout_s=args.shutdown_timeout,
        **scaling).bind(args, make_engine)
    src = loader.resolve(args.model)
    env = {k: os.environ.get(k, v) for k, v in PROBE_DEADLINES.items()}
    ingress = serve.deployment(Ingress).options(name="Ingress",
                                                ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
                                                max_ongoing_requests=100_000)
    return ingress.bind(replicas, (src.kind, src.path, args.tokenizer), args.chat_template, block_size,
                        app_kwargs(args)["max_request_bytes"])


def serve_replicas(args, make_engine) -> int:
    import ray
    from ray import serve

    _scaling(args)  # bad options fail before Ray starts
    local = args.ray_address is None
    if local:  # a small footprint: no dashboard, a small object store (requests and tokens only)
        store = parse_size(args.ray_object_store_memory, "ray_object_store_memory")
        ray.init(include_dashboard=False, object_store_memory=store, num_cpus=os.cpu_count(),
                 log_to_driver=args.log_level == "debug")
    else:
        ray.init(address=args.ray_address, log_to_driver=args.log_level == "debug")
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"kvserve: starting {args.replicas or 1 if args.max_replicas is None else args.min_replicas} "
              f"replica(s) on Ray ({'local' if local else args.ray_address})", flush=True)
        serve.run(application(args, make_engine, args.router), name=APP_NAME, route_prefix="/")
        print(f"kvserve: listening at http://{args.host}:{args.port}/v1 | router {args.router}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)
            if local:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0
