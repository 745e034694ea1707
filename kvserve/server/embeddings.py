"""POST /v1/embeddings: the served model's final hidden states, pooled per input (mean or last
token, --embedding-pooling) and L2-normalised, in OpenAI's shape.

Each input runs as eager forwards on the engine thread over a scratch KV cache (the paged pool and
the running batch are untouched), a chunk of at most the step's token budget per call between two
steps (AsyncEngine.call; engine/pooling.py). One input is in flight at a time, so one scratch cache
exists at a time, as when each input was a single call.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib

import numpy as np

from kvserve.engine.async_engine import EngineDeadError
from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import EmbeddingRequest
from kvserve.server.responses import Embedding, EmbeddingResponse, EmbeddingUsage
from kvserve.server.state import ServerState

ENGINE_POLL_S = 0.5  # how often a waiting request checks that the engine thread is still alive


async def _on_engine(state: ServerState, fn):
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run(eng):
        try:
            fut.set_result(fn(eng))
        except BaseException as e:  # noqa: BLE001 - handed to the request
            fut.set_exception(e)

    state.engine.call(run)
    wrapped = asyncio.wrap_future(fut)
    while True:
        done, _ = await asyncio.wait({wrapped}, timeout=ENGINE_POLL_S)
        if done:
            return wrapped.result()
        if not state.engine.healthy:
            wrapped.cancel()
            raise EngineDeadError("the engine stopped before the embedding was computed")


async def _embed(state: ServerState, x, pooling: str, field: str) -> tuple[list[float], int]:
    async with state.embedding_lock:
        job = await _on_engine(state, lambda eng: eng.embedding(x, pooling, field))
        try:
            while not job.done:
                await _on_engine(state, lambda eng: eng.embedding_step(job))
        finally:
            if not job.done:  # the engine died or the request was cancelled: free the scratch cache
                with contextlib.suppress(EngineDeadError):
                    state.engine.call(lambda eng: job.close())
        return job.result(), len(job.ids)


async def create(state: ServerState, req: EmbeddingRequest) -> EmbeddingResponse:
    state.check_model(req.model)
    inputs = req.inputs()
    width = state.engine.engine.arch.hidden_size
    if req.dimensions is not None and req.dimensions != width:
        raise InvalidRequestError("dimensions", f"this model's embeddings have {width} dimensions and cannot be "
                                  f"shortened; omit dimensions or give {width}")
    pooling = state.config.embedding_pooling
    data, tokens = [], 0
    for i, x in enumerate(inputs):
        field = "input" if x is req.input else f"input[{i}]"
        vec, n = await _embed(state, x, pooling, field)
        tokens += n
        out = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode() \
            if req.encoding_format == "base64" else vec
        data.append(Embedding(index=i, embedding=out))
    return EmbeddingResponse(data=data, model=state.config.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
