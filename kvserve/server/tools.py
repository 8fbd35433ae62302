"""Tool calls for chat: which tools a request may call, the grammar that makes a call parse,
and the calls read back out of the generated text.

``tool_choice``     what the model generates                            constrained to
  none              text (the tools are not shown to the template)      nothing
  auto              text, which may hold ``<tool_call>{...}</tool_call>``   nothing (see below)
                    blocks; the tools are rendered by the chat template
                    when it declares them, else ``auto`` is ``none``
  required          ``[{"name": ..., "arguments": {...}}, ...]``         one tool's parameters per item
  {function: name}  that function's arguments object                    its parameters schema

``required`` and a named function work with any model: the grammar makes the output a
call that parses. ``auto`` needs a model trained to call tools and a template that
declares them; calls are read from ``<tool_call>`` blocks holding ``{"name", "arguments"}``
JSON (the Hermes format, which Qwen2.5's and SmolLM3's templates ask for), the text
around them becomes the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import StructuredOutputs
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, Tool, bad_request

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                  # none, auto, required, named
    tools: tuple[Tool, ...]
    structured: StructuredOutputs | None       # the grammar of a call (required, named)
    template_tools: list[dict[str, Any]] | None   # what the chat template gets as ``tools``
    name: str | None = None                    # the named function

    @property
    def makes_calls(self) -> bool:
        """The output is constrained to be calls (required, named)."""
        return self.structured is not None

    @property
    def reads_calls(self) -> bool:
        """The output is read for calls (required, named, and auto with a template that shows the tools)."""
        return self.makes_calls or self.mode == "auto"


def plan_tools(req: ChatCompletionRequest, template_declares_tools: bool) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice``; 400 naming the problem."""
    tools = tuple(req.tools or ())
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is given twice", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools to choose from", "tool_choice")
    mode: str
    if isinstance(choice, str):
        mode, name = choice, None
    else:
        mode, name = "named", choice.function.name
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"(known: {', '.join(names)})", "tool_choice")
    if name is not None:
        tool = tools[names.index(name)]
        spec = _spec(parameters(tool), "tools")
    elif mode == "required":
        spec = _spec(required_schema(tools, req.parallel_tool_calls is not False), "tools")
    else:
        spec = None
    shown = mode != "none" and (mode != "auto" or template_declares_tools)
    template_tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools] if shown else None
    return ToolPlan("auto" if mode == "auto" and template_declares_tools else ("none" if mode == "auto" else mode),
                    tools, spec, template_tools, name)


def parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def required_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    """A list of one or more calls, each a known tool's name and its arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _spec(schema: dict[str, Any], param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=json.dumps(schema))
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """The content and OpenAI ``tool_calls`` in ``text``, or None when it holds no complete
    call (cut by max_tokens; no call in an ``auto`` reply)."""
    if plan.mode == "auto":
        return _hermes_calls(plan, text)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls: list[tuple[str, Any]]
    if plan.name is not None:
        calls = [(plan.name, value)]
    elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
        calls = [(c["name"], c.get("arguments", {})) for c in value]
    else:
        return None
    return None, [_call(name, args) for name, args in calls]


def _hermes_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks naming known tools;
    None unless every block is one (a malformed call stays text, as the model wrote it)."""
    known = {t.function.name for t in plan.tools}
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in known:
            return None
        calls.append(_call(value["name"], value.get("arguments", value.get("parameters", {}))))
    if not calls:
        return None
    content = _HERMES_CALL.sub("", text).strip()
    return content or None, calls


def _call(name: str, args: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them. An assistant turn that called tools keeps its
    ``tool_calls`` (arguments parsed, as templates expect); when it has no text, its content
    is the calls as this server's ``required`` output writes them, so a template that knows
    nothing of tools still shows the model what it called."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                               for c, call in zip(m.tool_calls, calls)]
            if not d["content"]:
                d["content"] = json.dumps(calls, ensure_ascii=False)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"messages: tool call arguments must be JSON text, got {text!r:.80}", "messages") from None
