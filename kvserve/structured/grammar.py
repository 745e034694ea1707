"""xgrammar behind three small pieces: a compiler with a bounded cache, a matcher per sequence,
and the batch's token bitmask.

Why xgrammar: its token masks come from a per-grammar cache of context-independent tokens, so
filling one row costs microseconds to tens of microseconds on the host; its matchers fork (n > 1)
and roll back (speculative tokens); it applies the bitmask with a CPU kernel and a Triton one;
vLLM and SGLang ship it by default, so its JSON-schema coverage is what users already meet.

JSON is generated compact (``", "`` and ``": "`` separators, no free whitespace): a model cannot
spend its budget on whitespace, and every output still parses as the schema asks.

xgrammar is imported on the first structured request: engines that never see one do not pay
for its import.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens of KiB to a few MiB)
DEFAULT_CACHE_BYTES = 256 << 20  # and at most this much memory between them
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgr():
    import xgrammar
    return xgrammar


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _CPP_PREFIX.sub("", str(e).strip()).splitlines()[0][:500]


def _choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings."""
    lit = ['"' + c.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
           .replace("\t", "\\t") + '"' for c in choices]
    return "root ::= " + " | ".join(lit)


class GrammarState:
    """One sequence's position in its grammar. Tokens go in as a list (a step may accept several
    with speculative decoding) and can be rolled back.

    The engine's step queues each sampled token (``defer``) instead of feeding it: the next
    mask's fill feeds the queue off the engine's thread (``BitmaskFiller``), and every other
    use of the matcher feeds it first. A queued token was sampled under this state's mask, so
    the matcher accepts it, and it ends the grammar exactly when it is a stop token; a token
    the matcher refuses anyway (a row left with nothing allowed) sets ``refused``."""
    __slots__ = ("matcher", "stop_token_ids", "pending", "refused")

    def __init__(self, matcher):
        self.matcher = matcher
        self.stop_token_ids = frozenset(matcher.stop_token_ids)
        self.pending: list[int] = []  # sampled, not yet fed to the matcher
        self.refused = False

    def defer(self, token_id: int) -> bool:
        """Queue a token sampled under this state's mask. True if the grammar ends with it (its
        stop token) or has already refused one: the output ends there either way."""
        self.pending.append(token_id)
        return self.refused or token_id in self.stop_token_ids

    def feed_pending(self) -> None:
        if self.pending:
            toks, self.pending = self.pending, []
            if self._accept(toks) < len(toks):
                self.refused = True

    def _accept(self, token_ids: list[int]) -> int:
        for k, t in enumerate(token_ids):
            if not self.matcher.accept_token(t):
                return k
        return len(token_ids)

    def accept(self, token_ids: list[int]) -> int:
        """Feed tokens in order; returns how many were accepted (stops at the first refused)."""
        self.feed_pending()
        return self._accept(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.feed_pending()
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fork(self) -> GrammarState:
        self.feed_pending()
        child = GrammarState(self.matcher.fork())
        child.refused = self.refused
        return child

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the output ends here."""
        self.feed_pending()
        return self.matcher.is_terminated()


def feed_pending(states: list[GrammarState]) -> None:
    """Feed every state's queued tokens, one token each in one xgrammar call (the usual step)."""
    single = [s for s in states if len(s.pending) == 1 and not s.refused]
    if single:
        ok = _xgr().BatchGrammarMatcher.batch_accept_token([s.matcher for s in single],
                                                           [s.pending[0] for s in single])
        for s, accepted in zip(single, ok):
            s.pending.clear()
            s.refused = not accepted
    for s in states:
        s.feed_pending()


class StructuredCompiler:
    """Compiles specs against one tokenizer. Compiled grammars are kept by canonical spec in an
    LRU of ``cache_size`` entries and ``cache_bytes`` (the newest always stays); compiling happens
    when a request is admitted (a bad spec is refused there), never in the step. Safe
    to call from several threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width; may exceed the tokenizer's (padded rows)
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured_outputs", "this model has no tokenizer; structured outputs "
                                          "need one to know what each token spells")
            xgr = _xgr()
            try:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
            except (RuntimeError, ValueError, TypeError) as e:  # e.g. a tokenizer larger than the logits
                raise InvalidRequestError("structured_outputs", f"this model's tokenizer cannot be used for "
                                          f"grammars: {_reason(e)}") from None
            # One cache, ours: xgrammar's own is keyed the same way and would hold everything twice.
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for ``spec``; InvalidRequestError naming the field if it does not
        compile."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiler = self._get_compiler()
        compiled = self._compile(compiler, spec)  # outside the lock: others' hits need not wait
        _check_not_empty(compiled, spec, self.vocab_size)
        with self._lock:
            if key not in self._cache:  # another thread may have compiled it meanwhile
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                            or self._cached_bytes > self.cache_bytes):
                self._cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compile(self, compiler, spec: StructuredOutputsParams):
        kind = spec.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                _check_schema(schema, field)
                return compiler.compile_grammar(_json_grammar(schema))
            if kind == "json_object":
                # Any object: strict mode would close it to {} (no additional properties).
                return compiler.compile_grammar(_json_grammar({"type": "object"}, strict_mode=False))
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "the JSON schema", "regex": "the regular expression", "choice": "the choices",
                    "grammar": "the EBNF grammar"}.get(kind, kind)
            raise InvalidRequestError(field, f"{what} cannot be compiled: {_reason(e)}") from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(_xgr().GrammarMatcher(self.compile(spec)))


# A JSON string's characters as xgrammar 0.2.9 writes them: plain strings exclude control
# characters, strings with minLength/maxLength do not (JSON forbids them raw: json.loads refuses
# such output); neither excludes the UTF-16 surrogates, whose UTF-8 encodings are not UTF-8 at all
# (a byte-level vocabulary can spell them; the text then shows U+FFFD and outgrows maxLength).
_STRING_CHARS = (r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\r\n]')
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def _json_grammar(schema, strict_mode: bool = True):
    """The schema's grammar, as compact JSON, with its string characters limited to JSON's."""
    xgr = _xgr()
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    for loose in _STRING_CHARS:
        text = text.replace(loose, _JSON_CHAR)
    return xgr.Grammar.from_ebnf(text)


def _check_schema(schema, field: str) -> None:
    """A schema must be valid against its own metaschema (jsonschema's check), before xgrammar
    reads it: xgrammar skips what it does not know, which would hide a typo. And it must not lean
    on what xgrammar reads but does not enforce: the output would look constrained and not be."""
    import jsonschema
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(field, "must be a JSON schema (an object)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise InvalidRequestError(field, f"is not a valid JSON schema{f' at {where}' if where else ''}: "
                                  f"{e.message[:300]}") from None
    found = _unenforced(schema)
    if found is not None:
        where, what = found
        raise InvalidRequestError(field, f"uses {what} at {where or '/'}, which constrained decoding cannot "
                                  f"enforce (the output would not be held to it); express it otherwise or leave it out")


# Keywords xgrammar accepts and ignores (xgrammar 0.2: each lets through output that breaks it),
# and where a schema holds schemas, by keyword: a map of them, one, or a list.
_UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _unenforced(schema) -> tuple[str, str] | None:
    """(JSON pointer, what) of the first unenforced construct in ``schema``, or None."""
    stack = [(schema, "")]
    while stack:
        s, at = stack.pop()
        if not isinstance(s, dict):
            continue
        for k in _UNENFORCED:
            if k in s:
                return at, f"'{k}'"
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            return at, "'allOf' over several schemas"
        ref = s.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            return at, f"'$ref' to another document ({ref[:100]!r}; only '#/...' references are read)"
        for k in _SCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend((v, f"{at}/{k}/{n}") for n, v in s[k].items())
        stack.extend((s.get(k), f"{at}/{k}") for k in _SCHEMA_ONE if isinstance(s.get(k), dict))
        for k in _SCHEMA_LISTS:
            if isinstance(s.get(k), list):
                stack.extend((v, f"{at}/{k}/{i}") for i, v in enumerate(s[k]))
    return None


class BitmaskFiller:
    """The step's token bitmask, filled on the host from each constrained row's matcher (one
    int32 word per 32 tokens; a set bit allows the token). Only the listed rows are written and
    only they are applied; the others hold whatever an earlier step left.

    ``start`` fills on a worker thread (xgrammar's fill releases the GIL), so the host can queue
    the forward, or fold in the previous step, meanwhile; ``result()`` waits for it.

    Two pinned buffers take turns (pinned on CUDA: the copy to the device is asynchronous). The
    engine has at most two steps in flight and fills their masks in launch order, so when a fill
    takes a buffer, the step that used it last has completed and its copy is done."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.pin = device.type == "cuda"
        self._batch = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._worker = None

    def _buffer(self, num_rows: int) -> torch.Tensor:
        xgr = _xgr()
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < num_rows:
            rows = max(num_rows, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty(xgr.get_bitmask_shape(rows, self.vocab_size), dtype=xgr.bitmask_dtype,
                              pin_memory=self.pin)
            self._buffers[self._turn] = buf
        return buf[:num_rows]

    def __call__(self, num_rows: int, rows: list[int], states: list[GrammarState]) -> torch.Tensor:
        return self.start(num_rows, rows, states).result()[0]

    def start(self, num_rows: int, rows: list[int], states: list[GrammarState]) -> Future:
        """Feed ``states`` their queued tokens and fill ``rows`` of a ``num_rows`` mask from them,
        on the worker thread. The future gives (the mask, the rows written): a terminated or
        refusing matcher allows nothing, so its row is left out and sampled unconstrained (the
        token is dropped, or ends the output). The matchers must not move until the future is
        done.

        xgrammar's two calls (feed, fill) release the GIL while they run; the worker needs it
        only briefly before, between and after them. What can be done in Python is done here,
        and this thread waits until the worker has taken the job, so that the worker does not
        queue for the GIL behind the engine's Python for a switch interval (5 ms)."""
        mask = self._buffer(num_rows)
        if self._worker is None:
            self._batch = _xgr().BatchGrammarMatcher(max_threads="auto")
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-bitmask")
        first: dict[int, int] = {}  # matcher -> the row filled from it (n > 1 draws share one)
        own, copies = [], []
        for row, s in zip(rows, states):
            src = first.setdefault(id(s), row)
            if src == row:
                own.append((row, s))
            else:
                copies.append((row, src))
        started = threading.Event()
        job = self._worker.submit(self._fill, started, mask, own, copies)
        started.wait()
        return job

    def _fill(self, started: threading.Event, mask: torch.Tensor, own: list[tuple[int, GrammarState]],
              copies: list[tuple[int, int]]):
        started.set()
        feed_pending([s for _, s in own])
        live = [(row, s) for row, s in own if not s.refused and not s.matcher.is_terminated()]
        fill_rows = [row for row, _ in live]
        if fill_rows:
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in live], mask, indices=fill_rows)
            with torch.inference_mode():
                allow_stop_where_dead(mask, fill_rows, [s for _, s in live])
        filled = set(fill_rows)
        copies = [(row, src) for row, src in copies if src in filled]
        with torch.inference_mode():  # the buffer may be an inference tensor (made in the step)
            for row, src in copies:
                mask[row] = mask[src]
        return mask, sorted(fill_rows + [r for r, _ in copies])


def _check_not_empty(compiled, spec: StructuredOutputsParams, vocab_size: int) -> None:
    """A grammar under which no first token is allowed (not even the stop token) matches no
    output at all ("root ::= root", the regex [^\\s\\S]): refused, rather than decoded from a
    mask that allows nothing."""
    xgr = _xgr()
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    if not mask.any():
        raise InvalidRequestError(f"structured_outputs.{spec.kind}", "matches no output at all (its language is "
                                  "empty for this model's vocabulary)")


def allow_stop_where_dead(mask: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """A row whose grammar allows no next token (a dead end: a rule that matches nothing, reached
    mid-output) may only end: its stop tokens are allowed, so the output stops there instead of
    taking a token the grammar refuses."""
    for i in (~mask[rows].any(1)).nonzero().flatten().tolist():  # one check for every row
        for t in states[i].stop_token_ids:
            bit = 1 << (t % 32)
            mask[rows[i], t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of the listed rows go to -inf, in place, on the logits' device."""
    _xgr().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=rows)
