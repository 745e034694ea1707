"""ServerState: what every endpoint reads (one per app), with the checks every generate call makes.

`engine` is None while the model loads (the HTTP server starts first; see loading.py); _Gate
answers 503 for every API path until it is set, so endpoints may assume it is there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import ConfigError
from kvserve.server.errors import APIError
from kvserve.server.metrics import Metrics

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ServerConfig:
    # The names clients may send as `model`; the first is the one /v1/models lists first and
    # responses carry. Empty: the engine's (default_names), filled in once it has loaded.
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024
    tool_call_parser: str = "auto"  # a name in tool_parsers.PARSERS, or auto: from the chat template
    embedding_pooling: str = "mean"  # /v1/embeddings: mean or last (engine/pooling.py)

    def __post_init__(self):
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ConfigError("served_model_name", f"names must be non-empty, got {list(self.served_model_names)}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
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
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{names[0]}`{also}.",
                           "model", "model_not_found")

    def check_capacity(self) -> None:
        """Refuse new work while the waiting queue is full (429), so load sheds instead of queueing."""
        waiting = self.engine.num_waiting
        if waiting >= self.config.max_waiting:
            raise APIError(429, f"The server is busy: {waiting} requests are waiting "
                           f"(limit {self.config.max_waiting}); retry later.", code="queue_full")
