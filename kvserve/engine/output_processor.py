"""OutputProcessor: turns the engine core's outputs into ``RequestOutput``s.

It keeps its own state per sequence (tokens, text, log-probs) and reads nothing but
``EngineCoreOutputs``, so it may run on the serving side's thread. Its rules:
- text is decoded incrementally (``Detokenizer``), token by token;
- a stop string counts once ``min_tokens`` tokens are out, unless the core already stopped the
  request on end-of-text or a stop token; it overrides a length finish at the same token. The
  sequences it stops are returned to the caller, which must finish them in the core;
- while a request runs, the text's tail that could still start a stop string is held back, so a
  stream never shows part of a stop string that is cut once it completes;
- a group (``n > 1``) is finished when all ``n`` of its sequences are, and is then forgotten.
"""
from __future__ import annotations

from kvserve.engine.detokenizer import Detokenizer, find_stop
from kvserve.engine.step import EngineCoreOutput, EngineCoreOutputs, RawPromptLogprob
from kvserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams


class RequestState:
    """One sequence as the caller sees it."""

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 metrics: RequestMetrics | None = None):
        self.index = index
        self.params = params
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Detokenizer window: text is decoded from prefix_offset, new from read_offset.
        self.output_text = ""
        self.prefix_offset = max(0, self.num_prompt_tokens - 5)
        self.read_offset = self.num_prompt_tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.metrics = metrics

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def fork(self, index: int) -> RequestState:
        """A sibling: forks happen at the first sampled token, so it starts from the prompt."""
        return RequestState(index, self.all_token_ids[:self.num_prompt_tokens], self.params)

    def visible_text(self) -> str:
        stops = self.params.stop_strings
        if self.is_finished or not stops or self.params.include_stop_str_in_output:
            return self.output_text
        hold = max(len(s) for s in stops) - 1
        return self.output_text[:max(0, len(self.output_text) - hold)]


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self._decode = self.detokenizer.decode_token if self.detokenizer else (lambda _: None)
        self.groups: dict[str, list[RequestState]] = {}
        self.prompts: dict[str, tuple[str | None, list[int]]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.groups[request_id] = [RequestState(0, prompt_token_ids, params)]
        self.prompts[request_id] = (prompt, list(prompt_token_ids))

    def abort(self, group_id: str) -> None:
        self.groups.pop(group_id, None)
        self.prompts.pop(group_id, None)

    def process(self, core: EngineCoreOutputs, only_finished: bool = False
                ) -> tuple[list[RequestOutput], list[tuple[str, int]], dict[str, BaseException]]:
        """Returns the outputs of every group that moved (with ``only_finished``, of those that
        finished), the (group id, index) of each sequence a stop string ended, and the groups
        whose own processing (detokenizing, log-probs) raised: the caller aborts those."""
        touched: dict[str, None] = {}
        stops: list[tuple[str, int]] = []
        failed: dict[str, BaseException] = {}
        groups = self.groups
        for co in core.outputs:
            group = groups.get(co.group_id)
            if group is None or co.group_id in failed:
                continue
            i = co.index
            try:
                state = group[i] if i < len(group) and group[i].index == i else self._state(group, co)
                if self._apply(state, co):
                    stops.append((co.group_id, co.index))
            except Exception as e:  # noqa: BLE001 - one request's fault; the caller aborts it
                failed[co.group_id] = e
                touched.pop(co.group_id, None)
                continue
            touched[co.group_id] = None
        stops = [st for st in stops if st[0] not in failed]
        outputs = []
        for gid in touched:
            group = self.groups[gid]
            finished = len(group) == group[0].params.n and all(s.is_finished for s in group)
            if only_finished and not finished:
                continue
            outputs.append(self._output(gid, group, finished))
            if finished:
                del self.groups[gid]
                del self.prompts[gid]
        return outputs, stops, failed

    @staticmethod
    def _state(group: list[RequestState], co: EngineCoreOutput) -> RequestState:
        if co.index < len(group) and group[co.index].index == co.index:
            return group[co.index]
        child = group[0].fork(co.index)  # a fork the core made this step
        group.append(child)
        group.sort(key=lambda s: s.index)
        return child

    def _apply(self, state: RequestState, co: EngineCoreOutput) -> bool:
        """Fold one core output in; True if a stop string ended a sequence the core still runs."""
        state.metrics = co.metrics
        if co.prompt_logprobs and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, co.prompt_logprobs_start, co.prompt_logprobs)
        p = state.params
        stop = None
        status = co.status
        finished = status.is_finished
        check_stops = bool(p.stop_strings) and not (finished and status.finish_reason == "stop")
        detok = self.detokenizer
        all_ids, out_ids = state.all_token_ids, state.output_token_ids
        for tok, lp in zip(co.new_token_ids, co.new_logprobs):
            all_ids.append(tok)
            out_ids.append(tok)
            if lp is not None:
                state.cumulative_logprob += lp[0]
                state.logprobs.append(self._logprob_dict(tok, lp[0], lp[1], lp[2]))
            n_new = detok.update(state) if detok is not None else 0
            if check_stops and len(out_ids) >= p.min_tokens:
                stop = find_stop(state, n_new)
                if stop is not None:
                    break
        if stop is not None:
            state.finish_reason, state.stop_reason = "stop", stop
            return not finished
        if finished:
            state.finish_reason, state.stop_reason = status.finish_reason, co.stop_reason
        return False

    def _add_prompt_logprobs(self, state: RequestState, start: int, raw: list[RawPromptLogprob]) -> None:
        # Entry i is prompt position i; a chunk recomputed after preemption overwrites.
        del state.prompt_logprobs[start + 1:]
        for tok, lp, rank, top in raw:
            state.prompt_logprobs.append(self._logprob_dict(tok, lp, rank, top))

    def _logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> PositionLogprobs:
        d = {tok: Logprob(lp, rank, self._decode(tok))}
        for r, (t, v) in enumerate(top, start=1):
            if t not in d:
                d[t] = Logprob(v, r, self._decode(t))
        return d

    def _output(self, group_id: str, group: list[RequestState], finished: bool) -> RequestOutput:
        first = group[0]
        prompt, prompt_ids = self.prompts[group_id]
        outs = [CompletionOutput(index=s.index, text=s.visible_text(), token_ids=list(s.output_token_ids),
                                 cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                                 logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in group]
        m = first.metrics
        return RequestOutput(request_id=group_id, prompt=prompt, prompt_token_ids=prompt_ids,
                             prompt_logprobs=first.prompt_logprobs, outputs=outs, finished=finished,
                             metrics=m, num_cached_tokens=m.num_cached_tokens + m.num_loaded_tokens)
