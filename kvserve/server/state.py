"""ServerState: what every endpoint reads (one per app), with the checks every generate call makes.

`engine` is None while the model loads (the HTTP server starts first; see loading.py); _Gate
answers 503 for every API path until it is set, so endpoints may assume it is there.

Tenants and prefix-cache isolation. A request's tenant is a keyed hash of the API key it came
with (never the key itself); None without keys. Its engine cache salt, by
`prefix_cache_isolation`:

    none     its cache_salt, if it sent one; else None (the shared prefix cache, as in vLLM)
    key      (tenant, cache_salt): tenants never share KV; within one, as in "none"
    request  (tenant, cache_salt), or without one (tenant, session), or else a fresh random
             salt: only requests that name the same cache_salt (or session) share KV

Sessions are the tenant's too: the engine knows a session as "<tenant>/<id>", so another key's
id of the same name is a different, unknown session.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import ConfigError
from kvserve.server.errors import APIError
from kvserve.server.metrics import Metrics

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

TENANT = "kvserve.tenant"  # ASGI scope keys set by app._Gate
AUTHORIZED = "kvserve.authorized"
OUTCOME = "kvserve.outcome"  # set by an endpoint whose outcome its status code does not tell
ISOLATION_MODES = ("none", "key", "request")


def tenant_of(api_key: str) -> str:
    """The tenant an API key names: an HMAC keyed by the key, so neither logs nor cache keys
    nor the KV tiers ever hold the key, and the same key names the same tenant on every replica."""
    return hmac.new(api_key.encode(), b"kvserve tenant", hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class ServerConfig:
    # The names clients may send as `model`; the first is the one /v1/models lists first and
    # responses carry. Empty: the engine's (default_names), filled in once it has loaded.
    served_model_names: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # empty: open; else each key is its own tenant
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024
    prefix_cache_isolation: str = "none"  # none | key | request (see the module docstring)
    metrics_public: bool = False  # /metrics without a key even when keys are set
    tool_call_parser: str = "auto"  # a name in tool_parsers.PARSERS, or auto: from the chat template
    embedding_pooling: str = "mean"  # /v1/embeddings: mean or last (engine/pooling.py)

    def __post_init__(self):
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ConfigError("served_model_name", f"names must be non-empty, got {list(self.served_model_names)}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ConfigError("api_key", "keys must be non-empty strings")
        if self.prefix_cache_isolation not in ISOLATION_MODES:
            raise ConfigError("prefix_cache_isolation", f"must be one of {', '.join(ISOLATION_MODES)}, "
                              f"got {self.prefix_cache_isolation!r}")
        if self.prefix_cache_isolation == "key" and not self.api_keys:
            raise ConfigError("prefix_cache_isolation", "'key' needs API keys (--api-key): it salts each "
                              "key's prefix cache apart")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ConfigError("tool_call_parser", f"must be auto, hermes or llama3_json, got {self.tool_call_parser!r}")
        if self.embedding_pooling not in ("mean", "last"):
            raise ConfigError("embedding_pooling", f"must be mean or last, got {self.embedding_pooling!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def default_names(engine: LLMEngine) -> tuple[str, ...]:
    """Without --served-model-name: the model's file or directory name, and the model as given
    (vLLM's default), e.g. ("m.gguf", "models/m.gguf")."""
    given = engine.config.model
    return (engine.model_name,) + ((given,) if given and given != engine.model_name else ())


@dataclass
class ServerState:
    engine: AsyncEngine | None
    config: ServerConfig
    metrics: Metrics
    load_error: BaseException | None = None  # the model failed to load; the server is going down
    embedding_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one embedded input at a time

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def set_engine(self, engine: AsyncEngine) -> None:
        if not self.config.served_model_names:
            self.config = replace(self.config, served_model_names=default_names(engine.engine))
        self.engine = engine

    def check_model(self, model: str | None) -> None:
        names = self.config.served_model_names
        if model is not None and model not in names:
            also = f" (also accepted: {', '.join(f'`{n}`' for n in names[1:])})" if len(names) > 1 else ""
            shown = model if len(model) <= 256 else model[:256] + "..."  # an oversized name is not echoed whole
            raise APIError(404, f"The model `{shown}` does not exist; this server serves `{names[0]}`{also}.",
                           "model", "model_not_found")

    def session_key(self, tenant: str | None, session_id: str | None) -> str | None:
        """The engine's name for a tenant's session."""
        if session_id is None or tenant is None:
            return session_id
        return f"{tenant}/{session_id}"

    def cache_salt(self, tenant: str | None, cache_salt: str | None, session_id: str | None) -> str | None:
        """The engine cache salt of a request (the isolation table in the module docstring).
        Every salt is a tagged JSON list, so no cache_salt sent in one mode can equal a salt
        made in another (replicas with different modes may share the Redis tier)."""
        mode = self.config.prefix_cache_isolation
        if mode == "none":
            return None if cache_salt is None else json.dumps(["salt", cache_salt])
        if mode == "key":
            return json.dumps(["key", tenant, cache_salt])
        if cache_salt is not None:
            return json.dumps(["request", tenant, cache_salt])
        if session_id is not None:
            return json.dumps(["session", tenant, session_id])
        return json.dumps(["once", secrets.token_hex(16)])

    def request_scope(self, req, raw) -> tuple[str | None, str | None]:
        """(engine session id, engine cache salt) of a completion request from its caller."""
        tenant = raw.scope.get(TENANT)
        return (self.session_key(tenant, req.session_id),
                self.cache_salt(tenant, req.cache_salt, req.session_id))

    def end_open_requests(self) -> None:
        """Shutdown past its grace time: every open request ends now with a 503 (a stream with
        an error event and [DONE]), its engine request aborted."""
        if self.engine is not None:
            self.engine.end_streams(lambda: APIError(503, "The server is shutting down; retry on another "
                                                     "replica or after it restarts.", code="server_shutting_down"))

    def check_capacity(self) -> None:
        """Refuse new work while the waiting queue is full (429), so load sheds instead of queueing."""
        waiting = self.engine.num_waiting
        if waiting >= self.config.max_waiting:
            raise APIError(429, f"The server is busy: {waiting} requests are waiting "
                           f"(limit {self.config.max_waiting}); retry later.", code="queue_full")
