"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + i.

`echo` puts the prompt (and with `logprobs` its tokens' logprobs) before each choice; `best_of`
samples that many per prompt and returns the n with the highest cumulative logprob.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.errors import InvalidRequestError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import streams as st
from kvserve.server.errors import sse_error
from kvserve.server.protocol import CompletionRequest
from kvserve.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from kvserve.server.state import OUTCOME, ServerState
from kvserve.tokenizer import token_bytes


def _logprobs(c: CompletionOutput, start: int, end: int, k: int | None, offset: int,
              tokenizer) -> CompletionLogprobs | None:
    if k is None:
        return None
    lp = CompletionLogprobs()
    for _, s, v, top in st.position_logprobs(c, start, end, k):
        lp.tokens.append(s)
        lp.token_logprobs.append(v)
        lp.top_logprobs.append({ts: x for _, ts, x in top})
    lp.text_offset = _offsets(c.token_ids[start:start + len(lp.tokens)], lp.tokens, offset, tokenizer)
    return lp


def _offsets(ids: list[int], tokens: list[str], start: int, tokenizer) -> list[int]:
    """Each token's first character in the text, from ``start``: counted over the tokens' bytes,
    so a character split across tokens counts once."""
    tb = token_bytes(tokenizer)
    if tb is not None:
        return tb.offsets(ids, start)
    out = []
    for s in tokens:
        out.append(start)
        start += len(s)
    return out


def _echo(o: RequestOutput, k: int | None, tokenizer) -> tuple[str, CompletionLogprobs | None]:
    """The prompt as echoed: its text and, when logprobs are asked, its tokens' logprobs (the
    first token has none, as OpenAI reports it)."""
    def tok_str(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"

    text = o.prompt if o.prompt is not None else tokenizer.decode(o.prompt_token_ids) if tokenizer else ""
    if k is None:
        return text, None
    lp = CompletionLogprobs()
    for j, t in enumerate(o.prompt_token_ids):
        d = o.prompt_logprobs[j] if o.prompt_logprobs and j < len(o.prompt_logprobs) else None
        if d is None:
            s, v, top = tok_str(t), None, None
        else:
            s = d[t].decoded_token if d[t].decoded_token is not None else tok_str(t)
            v = d[t].logprob
            top = {(x.decoded_token if x.decoded_token is not None else tok_str(u)): x.logprob
                   for u, x in sorted(d.items(), key=lambda kv: kv[1].rank)[:k]}
        lp.tokens.append(s)
        lp.token_logprobs.append(v)
        lp.top_logprobs.append(top)
    lp.text_offset = _offsets(list(o.prompt_token_ids), lp.tokens, 0, tokenizer)
    return text, lp


def _joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if head is None or tail is None:
        return tail
    return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)


def _best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples with the highest cumulative logprob, best first (OpenAI's and
    vLLM's rule); ties keep sampling order."""
    if len(outputs) == n:
        return outputs
    return sorted(outputs, key=lambda c: -c.cumulative_logprob)[:n]


async def create(state: ServerState, req: CompletionRequest, raw: Request):
    state.check_model(req.model)
    state.check_capacity()
    params = req.sampling_params(req.max_tokens, req.logprobs)
    samples = req.num_samples
    if samples != req.n or (req.echo and req.logprobs is not None):
        # best_of ranks by cumulative logprob, which the engine keeps when logprobs are on
        params = replace(params, n=samples, logprobs=req.logprobs if req.logprobs is not None else 0,
                         prompt_logprobs=req.logprobs if req.echo else None)
    rid = f"cmpl-{uuid.uuid4().hex}"
    try:
        streams = st.start(state.engine, rid, req.prompts(), params, *state.request_scope(req, raw))
    except InvalidRequestError as e:  # the engine's checks (a grammar compiles at admission) use its names
        raise req.as_sent(e) from None
    if req.stream:
        return StreamingResponse(_stream(state, req, rid, streams, raw), media_type="text/event-stream")
    try:
        outs = await st.collect(streams, raw)
    except st.ClientGone:
        return Response(status_code=499)  # nginx's "client closed request"; counted by the app, read by nobody
    choices = []
    tokenizer = state.engine.engine.tokenizer
    for i, o in enumerate(outs):
        state.metrics.observe_finished(o)
        head, head_lp = _echo(o, req.logprobs, tokenizer) if req.echo else ("", None)
        for j, c in enumerate(_best(o.outputs, req.n)):
            lp = _logprobs(c, 0, len(c.token_ids), req.logprobs, len(head), tokenizer)
            choices.append(CompletionChoice(index=i * req.n + j, text=head + c.text, logprobs=_joined(head_lp, lp),
                                            finish_reason=c.finish_reason))
    return CompletionResponse(id=rid, model=state.config.model_name, choices=choices, usage=st.usage(outs),
                              kv_transfer_params=outs[0].kv_transfer_params if len(outs) == 1 else None)


async def _stream(state: ServerState, req: CompletionRequest, rid: str, streams,
                  raw: Request) -> AsyncIterator[str]:
    n = req.n
    created, model = int(time.time()), state.config.model_name
    sent_chars: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    echoed: dict[int, str] = {}  # prompt index -> the prompt text sent at the head of its choices
    has_text = state.engine.engine.tokenizer is not None  # without one, outputs have token ids only
    try:
        async for i, out in st.merge(streams):
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                a, b = sent_chars.get(idx, 0), sent_toks.get(idx, 0)
                text, ntok = c.text[a:], len(c.token_ids)
                # No new text: tokens held back (partial UTF-8) wait for their character; a model
                # without a tokenizer never has text, so each new token gets its (empty) chunk,
                # which keeps time-to-first-token measurable by clients (`kvserve bench serve`).
                # the choice's first chunk starts with the prompt (its logprobs are all in by the first token)
                first_echo = req.echo and idx not in sent_chars and (ntok > 0 or c.finished)
                if not text and not c.finished and (has_text or ntok == b) and not first_echo:
                    continue
                if first_echo:
                    echoed[i], head_lp = _echo(out, req.logprobs, state.engine.engine.tokenizer)
                    text = echoed[i] + text
                lp = _logprobs(c, b, ntok, req.logprobs, a + len(echoed.get(i, "")), state.engine.engine.tokenizer)
                if first_echo:
                    lp = _joined(head_lp, lp)
                choice = CompletionChoice(index=idx, text=text, finish_reason=c.finish_reason, logprobs=lp)
                sent_chars[idx], sent_toks[idx] = len(c.text), ntok
                if c.finished:
                    done.add(idx)
                yield st.sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
            if out.finished:
                finals[i] = out
                state.metrics.observe_finished(out)
        if req.include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield st.sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                            usage=st.usage(outs)))
        yield st.DONE
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, then close
        raw.scope[OUTCOME] = "stream_error"  # the status line said 200; the count says this
        yield sse_error(e)
        yield st.DONE
