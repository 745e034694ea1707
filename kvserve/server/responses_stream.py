"""Server-sent events of a streamed Responses turn, with OpenAI's event names and order:

    response.created, response.in_progress
    per text item:  output_item.added, content_part.added, output_text.delta*, output_text.done,
                    content_part.done, output_item.done
    per call item:  output_item.added, function_call_arguments.delta, function_call_arguments.done,
                    output_item.done
    response.completed (or response.incomplete at max_output_tokens; an `error` event on a fault)

Each event is `event: <type>` plus `data: <json>` with a `sequence_number` counting from 0; the
Responses API ends the stream after the last event (no `[DONE]`). The output items sent are the
ones stored, so a streamed turn retrieves exactly as it was streamed.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from kvserve.server import streams as st
from kvserve.server import tool_parsers as tp
from kvserve.server.errors import to_api_error
from kvserve.server.responses_protocol import call_item, message_item
from kvserve.server.state import OUTCOME


class _Events:
    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


async def stream_events(turn, streams, parser, raw: Request) -> AsyncIterator[str]:
    ev, output = _Events(), []
    text_item: dict | None = None  # the message item open now, if any
    tools = tp.ToolStream(parser, turn.req.parallel_tool_calls) if parser else None
    sent = 0

    def open_text():
        nonlocal text_item
        text_item = message_item("", "in_progress")
        output.append(text_item)
        i = len(output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [ev("response.output_item.added", output_index=i, item={**text_item, "content": []}),
                ev("response.content_part.added", item_id=text_item["id"], output_index=i, content_index=0, part=part)]

    def close_text(status: str = "completed"):
        nonlocal text_item
        i, part = output.index(text_item), text_item["content"][0]
        text_item["status"] = status
        done = [ev("response.output_text.done", item_id=text_item["id"], output_index=i, content_index=0,
                   text=part["text"], logprobs=[]),
                ev("response.content_part.done", item_id=text_item["id"], output_index=i, content_index=0, part=part),
                ev("response.output_item.done", output_index=i, item=text_item)]
        text_item = None
        return done

    def add_text(delta: str):
        events = open_text() if text_item is None else []
        text_item["content"][0]["text"] += delta
        return events + [ev("response.output_text.delta", item_id=text_item["id"], output_index=output.index(text_item),
                            content_index=0, delta=delta, logprobs=[])]

    def add_call(call_id: str, name: str, args: str):
        events = close_text() if text_item is not None else []
        item = call_item(call_id, name, args, fid=f"fc_{uuid.uuid4().hex}")
        output.append(item)
        i = len(output) - 1
        return events + [
            ev("response.output_item.added", output_index=i, item={**item, "arguments": "", "status": "in_progress"}),
            ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=args),
            ev("response.function_call_arguments.done", item_id=item["id"], output_index=i, name=name, arguments=args),
            ev("response.output_item.done", output_index=i, item=item)]

    try:
        first = turn.body("in_progress", [])
        yield ev("response.created", response=first)
        yield ev("response.in_progress", response=first)
        final = None
        async for _, out in st.merge(streams):
            c = out.outputs[0]
            events = []
            if tools is None:
                if c.text[sent:]:
                    events += add_text(c.text[sent:])
                    sent = len(c.text)
            else:
                new, deltas = tools.update(c.text, c.finished)
                if new:
                    events += add_text(new)
                for k in range(0, len(deltas), 2):  # (id and name, arguments) per call
                    events += add_call(deltas[k].id, deltas[k].function.name, deltas[k + 1].function.arguments)
            for e in events:
                yield e
            if out.finished:
                final = out
        if text_item is None and not output:  # an empty reply is still one (empty) message
            for e in open_text():
                yield e
        if text_item is not None:  # the reply's last item: cut short by max_output_tokens, or complete
            cut = final is not None and final.outputs[0].finish_reason == "length"
            for e in close_text("incomplete" if cut else "completed"):
                yield e
        body = turn.finish(output, final)
        yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band, then close
        raw.scope[OUTCOME] = "stream_error"
        a = to_api_error(e)
        yield ev("error", code=a.code, message=a.message, param=a.param)
