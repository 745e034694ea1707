"""Tool calls in model output, as OpenAI `tool_calls`: one parser per output syntax (vLLM's names).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen2.5, Qwen3
                 <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>   SmolLM2
    llama3_json  {"name": ..., "parameters": {...}}; {...}                 Llama 3.1/3.2 (JSON calls)

A parser's `scan(text, final)` returns the content and the calls of the part of `text` that
later tokens cannot change: while streaming it holds back what may still become a call (an
open block, a suffix that may be the start of a tag), so successive scans only ever extend the
content and append calls. `ToolStream` turns that into OpenAI's deltas; the non-streaming reply
is the final scan, so the two always agree. A block whose JSON does not parse stays content.
A call is sent once its block is complete: its first delta has the name, the next its arguments.
"""
from __future__ import annotations

import json
import re

from kvserve.server.protocol import FunctionCall, ToolCall
from kvserve.server.responses import DeltaFunctionCall, DeltaToolCall
from kvserve.server.tools import assemble_forced, new_call_id

Call = tuple[str, str]  # (function name, arguments as JSON text)


def _call(obj, args_keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for k in args_keys:
        if isinstance(obj.get(k), dict):
            return obj["name"], json.dumps(obj[k], ensure_ascii=False)
    return (obj["name"], "{}") if not any(k in obj for k in args_keys) else None


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> tuple[str, list[Call]]:
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                rest = text[pos:]
                content.append(rest if final else rest[:len(rest) - _held_suffix(rest, self.START)])
                break
            content.append(text[pos:i])
            j = text.find(self.END, i)
            if j < 0 and not final:
                break
            end = len(text) if j < 0 else j + len(self.END)  # an unclosed block at the end: the model stopped
            got = self._calls(text[i + len(self.START):j if j >= 0 else len(text)])
            if got is None:
                content.append(text[i:end])
            else:
                calls.extend(got)
            pos = end
        return "".join(content), calls

    @staticmethod
    def _calls(body: str) -> list[Call] | None:
        try:
            v = json.loads(body)
        except ValueError:
            return None
        got = [_call(c, ("arguments", "parameters")) for c in (v if isinstance(v, list) else [v])]
        return got if got and all(got) else None


class Llama3JsonParser:
    _START = re.compile(r'\{\s*"name"\s*:')
    _PARTIAL = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')

    def scan(self, text: str, final: bool) -> tuple[str, list[Call]]:
        m = self._START.search(text)
        if m is None:
            k = text.rfind("{")
            if final or k < 0 or not self._PARTIAL.fullmatch(text, k):
                return text, []
            return text[:k], []
        head = text[:m.start()]
        if not final:
            return head, []
        calls = self._calls(text[m.start():])
        return (head.replace("<|python_tag|>", ""), calls) if calls is not None else (text, [])

    @staticmethod
    def _calls(s: str) -> list[Call] | None:
        dec, pos, calls = json.JSONDecoder(), 0, []
        while True:
            while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
                pos += 1
            if pos == len(s):
                return calls or None
            try:
                obj, pos = dec.raw_decode(s, pos)
            except ValueError:
                return None
            c = _call(obj, ("parameters", "arguments"))
            if c is None:
                return None
            calls.append(c)


class ForcedParser:
    """`required` and named tool_choice: the whole reply is JSON, read once it is complete."""

    def __init__(self, how: str):
        self.how = how

    def scan(self, text: str, final: bool) -> tuple[str, list[Call]]:
        if not final:
            return "", []
        calls = assemble_forced(text, self.how)
        return ("", [(c.function.name, c.function.arguments) for c in calls]) if calls else (text, [])


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def detect(chat_template) -> str:
    """The parser for a chat template's tool-call syntax; hermes for templates without tools
    (the fallback prompt asks for SmolLM2's <tool_call>[...] form, which hermes reads)."""
    t = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" in t or "tools" not in t:
        return "hermes"
    if "<|python_tag|>" in t or '"parameters"' in t:
        return "llama3_json"
    return "hermes"


def parse(parser, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content or None, tool calls) of a finished reply."""
    content, calls = parser.scan(text, True)
    calls = calls if parallel else calls[:1]
    return (content if content.strip() else None,
            [ToolCall(id=new_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls])


class ToolStream:
    """One choice's streamed reply: feed it the whole text so far, get what is new to send.
    Whitespace-only content is held (the non-streaming reply reports it as no content)."""

    def __init__(self, parser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.sent, self.num_calls = "", 0

    def update(self, text: str, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
        content, calls = self.parser.scan(text, final)
        calls = calls if self.parallel else calls[:1]
        new = None
        if self.sent or content.strip():
            new, self.sent = content[len(self.sent):] or None, content
        deltas = []
        for k, (name, args) in enumerate(calls[self.num_calls:], start=self.num_calls):
            deltas.append(DeltaToolCall(index=k, id=new_call_id(), type="function",
                                        function=DeltaFunctionCall(name=name, arguments="")))
            deltas.append(DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=args)))
        self.num_calls = len(calls)
        return new, deltas
