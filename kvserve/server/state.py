"""ServerState: what every endpoint reads (one per app), with the checks every generate call makes.

`engine` is None while the model loads (the HTTP server starts first; see loading.py); _Gate
answers 503 for every API path until it is set, so endpoints may assume it is there.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.errors import APIError
from kvserve.server.metrics import Metrics


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None  # None: the engine's model name, filled in once it has loaded
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024

    def __post_init__(self):
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name: must be non-empty")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")


@dataclass
class ServerState:
    engine: AsyncEngine | None
    config: ServerConfig
    metrics: Metrics
    load_error: BaseException | None = None  # the model failed to load; the server is going down

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.config.served_model_name}`.", "model", "model_not_found")

    def check_capacity(self) -> None:
        """Refuse new work while the waiting queue is full (429), so load sheds instead of queueing."""
        waiting = self.engine.num_waiting
        if waiting >= self.config.max_waiting:
            raise APIError(429, f"The server is busy: {waiting} requests are waiting "
                           f"(limit {self.config.max_waiting}); retry later.", code="queue_full")
