"""OpenAI ``tools`` and ``tool_choice`` on chat: checked definitions, the
grammar that enforces ``required`` and a named function, and the messages
the chat template sees.

``tool_choice``:
  none      the tools are not shown; plain text.
  auto      the tools are shown; the model's text is searched for calls by
            the gateway's ``--tool-call-parser`` (gateway/tool_parsers.py).
  required  the output is held by the grammar to a JSON array of
            ``{"name": ..., "parameters": {...}}``, one or more, each name a
            given tool and its parameters that tool's schema.
  named     the output is held to the named tool's parameters schema: it
            is the call's arguments.
So under ``required`` and a named function the arguments always parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.structured import InvalidField, build

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    raw: dict[str, Any]  # as the client sent it: what the chat template gets


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, for "named"


def parse_tools(raw: list[Any] | None) -> list[Tool]:
    """The request's tool definitions; InvalidField("tools") for a bad one."""
    tools: list[Tool] = []
    for i, t in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise InvalidField("tools", f"{where} must be an object of type 'function'")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidField("tools", f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidField("tools", f"{where}.function.name must be 1-64 letters, digits, "
                                        f"'_' or '-', got {name!r}")
        if any(other.name == name for other in tools):
            raise InvalidField("tools", f"{where}.function.name {name!r} is given twice")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        build("tools", {"json": params}, f"{where}.function.parameters")  # compiles, or 400
        tools.append(Tool(name, params, {"type": "function", "function": fn}))
    return tools


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidField("tool_choice", "tool_choice must be 'none', 'auto', 'required' "
                                              f"or a named function, got {raw!r}")
        if raw != "none" and not tools:
            raise InvalidField("tool_choice", f"tool_choice {raw!r} needs tools")
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidField("tool_choice", "tool_choice must name a function: "
                                          '{"type": "function", "function": {"name": ...}}')
    if not any(t.name == name for t in tools):
        raise InvalidField("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolChoice("named", name)


def tool_constraint(choice: ToolChoice, tools: list[Tool],
                    parallel: bool = True) -> dict[str, Any] | None:
    """The JSON Schema the output is held to, or None (free text).
    ``parallel=False`` (OpenAI's parallel_tool_calls): at most one call."""
    if choice.mode == "named":
        return next(t.parameters for t in tools if t.name == choice.name)
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "parameters": t.parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def chat_messages(messages: list[Any], tools: list[Tool], choice: ToolChoice,
                  template: str, parser_format: Any) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools the chat template gets. A template that knows
    tools (Qwen2.5, Llama 3.1...) gets them as they are; for one that does
    not (SmolLM2's ChatML), the tools go in a system message and earlier
    calls and results are written as text in the parser's format."""
    shown = [t.raw for t in tools] if choice.mode != "none" else None
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        calls = getattr(m, "tool_calls", None) or []
        if calls:
            msg["tool_calls"] = [template_call(c) for c in calls]
        if m.role == "tool":
            msg["tool_call_id"] = getattr(m, "tool_call_id", None)
        out.append(msg)
    if "tools" in template:  # it renders tools, calls and results itself
        return out, shown
    for msg in out:
        calls = msg.pop("tool_calls", None)
        if calls:
            msg["content"] = (msg["content"] + "".join(
                parser_format.render_call(c["function"]["name"], c["function"]["arguments"])
                for c in calls)).strip()
        if msg["role"] == "tool":
            del msg["tool_call_id"]
            msg.update(role="user", content=parser_format.render_result(msg["content"]))
    if shown:
        system = parser_format.system_prompt(shown)
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + system
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def template_call(call: Any) -> dict[str, Any]:
    """An OpenAI tool call from a chat's history as chat templates take it:
    its arguments an object, not JSON text."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidField("messages", "each tool_calls entry must be an object with a function")
    fn = call["function"]
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except (ValueError, RecursionError):  # RecursionError: nested too deep to read
        raise InvalidField("messages", f"tool call arguments are not JSON: {args[:80]!r}") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": args}}
