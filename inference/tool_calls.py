"""Tool calling for a model whose chat template knows no tools: the Hermes format.

The tools go into the prompt as a system message (`system_prompt`), the model calls one by
writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and decoding is held to that by a grammar (`grammar`): with `tool_choice` "required" or a named
function, from the first token; with "auto" the model may write text, and once it writes
`<tool_call>` the call that follows is constrained (an llguidance lazy lexeme). Arguments always
validate against the function's `parameters`. `CallParser` turns the output, whole or as it
streams, back into OpenAI's `tool_calls`; earlier calls and tool results in the history are
rendered in the same format (`render_history`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from inference.engine.api import Grammar
from inference.engine.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it lets the model do with them."""

    functions: tuple[dict, ...]  # each {"name", "description", "parameters"}
    choice: str  # "auto" | "required" | "none" | "function" (named: `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"


def conversation(messages: list[dict], tools: Tools | None, template_knows_tools: bool) -> tuple[list[dict], list | None]:
    """The messages and the `tools` argument the chat template is rendered with: the tools the
    model may call go to a template that renders tools itself, else first, as the Hermes system
    prompt. Calls are held to the Hermes format either way (the one tool-aware templates of
    Qwen2.5 and Hermes models teach)."""
    if tools is None or not tools.active:
        return messages, None
    if template_knows_tools:
        return messages, [{"type": "function", "function": f} for f in _offered(tools)]
    return [{"role": "system", "content": system_prompt(tools)}, *messages], None


def _offered(tools: Tools) -> list[dict]:
    return [f for f in tools.functions if tools.name is None or f["name"] == tools.name]


def system_prompt(tools: Tools) -> str:
    """What the model is told of its tools (the only ones it may call under a named choice)."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in _offered(tools))
    how = "You must call one of them." if tools.choice in ("required", "function") else \
        "Call one when it helps answer; otherwise answer in text."
    return (f"You can call these functions. Their signatures, as JSON schemas, are within <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n{how} To call a function, reply with its name and arguments as JSON "
            f"within <tool_call></tool_call>:\n{OPEN}{{\"name\": <function-name>, \"arguments\": <arguments-json-object>}}{CLOSE}")


def _call_schema(tools: Tools) -> str:
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in _offered(tools)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _lark(text: str) -> str:
    return json.dumps(text)


def grammar(tools: Tools) -> Grammar | None:
    """The grammar decoding is held to, or None when the model may not call (tool_choice none)."""
    if not tools.active:
        return None
    call = f"call: {_lark(OPEN)} %json {_call_schema(tools)} {_lark(CLOSE)}"
    if tools.choice == "auto":
        # Free text until the model writes the opening tag; what follows it is a call (lazy: the
        # text lexeme ends at the tag instead of swallowing it).
        many = "call*" if tools.parallel else "call?"
        source = (f"%llguidance {{}}\nstart: {many} tail\ntail: TEXT\nTEXT: /(.|\\n)*/\n"
                  f"opening[lazy]: TEXT {_lark(OPEN.rstrip())}\n"
                  f"call: opening {_lark(OPEN[len(OPEN.rstrip()):])} %json {_call_schema(tools)} {_lark(CLOSE)}\n")
    elif tools.choice == "required" and tools.parallel:
        source = f"start: call ({_lark(chr(10))} call)*\n{call}\n"
    else:  # required without parallel calls, or one named function: exactly one call
        source = f"start: call\n{call}\n"
    return Grammar("lark", source, param="tools")


def render_history(message: dict) -> str:
    """An assistant message's earlier calls, as the model wrote them (after its text)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = json.loads(function["arguments"]) if function.get("arguments") else {}
        calls.append(OPEN + json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False) + CLOSE)
    return "\n".join(calls)


def render_result(content: str) -> str:
    """A tool message's content, as the format hands results back."""
    return f"<tool_response>\n{content}\n</tool_response>"


@dataclass
class CallParser:
    """One choice's output split into content and calls, fed as it streams. Text that could be
    the start of a call is held back until it is known not to be."""

    calls: list[dict] = field(default_factory=list)
    _buffer: str = ""
    _after_call: bool = False  # the newlines that separate calls are not content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """New content to send, and the calls completed by `text`; `final` flushes what is held."""
        self._buffer += text
        content, done = [], []
        while True:
            if self._after_call:
                self._buffer = self._buffer.lstrip("\n")
                self._after_call = not self._buffer
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            end = self._buffer.find(CLOSE, start + len(OPEN))
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                if final:  # cut off mid-call (max_tokens): the client gets the text as it is
                    content.append(self._buffer)
                    self._buffer = ""
                break
            content.append(self._buffer[:start])
            call = self._parse(self._buffer[start + len(OPEN):end], len(self.calls) + len(done))
            if call is None:
                content.append(self._buffer[start:end + len(CLOSE)])
            else:
                done.append(call)
            self._buffer = self._buffer[end + len(CLOSE):]
            self._after_call = call is not None
        self.calls += done
        return "".join(content), done

    @staticmethod
    def _parse(body: str, index: int) -> dict | None:
        try:
            data = json.loads(body)
            name, arguments = data["name"], data["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
