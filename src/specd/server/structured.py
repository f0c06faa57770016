"""Output constraints asked for over HTTP (response_format, tool_choice, guided_*) -> StructuredOutput, and a forced
tool call's generated text -> OpenAI's `tool_calls`.

A forced tool call is generated as JSON under a schema built from the tools:
- named (`{"type": "function", "function": {"name": N}}`): the output is N's arguments object itself, constrained by
  its `parameters` schema;
- "required": a list of 1+ calls `[{"name": ..., "arguments": {...}}]` (at most one with parallel_tool_calls false),
  each call constrained by its tool's schema.
fields.judge has checked the combinations before any of this runs.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specd.sampling.params import StructuredOutput
from specd.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    SamplingRequest,
    Tool,
    ToolCall,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def structured_output(request: SamplingRequest) -> StructuredOutput | None:
    """The request's constraint, if it asks for one; `field` names what the client sent."""
    if request.guided_json is not None:
        return StructuredOutput("json_schema", request.guided_json, "guided_json")
    if request.guided_regex is not None:
        return StructuredOutput("regex", request.guided_regex, "guided_regex")
    if request.guided_choice is not None:
        return StructuredOutput("choice", request.guided_choice, "guided_choice")
    if request.guided_grammar is not None:
        return StructuredOutput("grammar", request.guided_grammar, "guided_grammar")
    if not isinstance(request, ChatCompletionRequest):
        return None
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        return StructuredOutput("json_object", None, "response_format")
    if response_format is not None and response_format.type == "json_schema" and response_format.json_schema:
        schema = response_format.json_schema.schema_
        return StructuredOutput("json_schema", True if schema is None else schema, "response_format.json_schema")
    tool = forced_tool(request)
    if tool is not None:
        return StructuredOutput("json_schema", tool.function.parameters or _ANY_OBJECT, "tools.function.parameters")
    if request.tool_choice == "required" and request.tools:
        return StructuredOutput("json_schema", _calls_schema(request.tools, request.parallel_tool_calls is False),
                                "tools")
    return None


def forced_tool(request: ChatCompletionRequest) -> Tool | None:
    """The tool a named tool_choice forces (None for any other choice)."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    return next(t for t in request.tools or [] if t.function.name == choice.function.name)


def calls_tools(request: ChatCompletionRequest) -> bool:
    """Whether the output is tool calls (named or "required"), not message content."""
    return forced_tool(request) is not None or (request.tool_choice == "required" and bool(request.tools))


def _calls_schema(tools: list[Tool], single: bool) -> dict[str, Any]:
    call = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(request: ChatCompletionRequest, text: str, ids: list[str]) -> list[ToolCall] | None:
    """The calls in a finished output, or None when it is not complete JSON (cut by max_tokens or a stop string:
    the caller returns the text as content then, with its finish_reason). `ids` are reused in order, so a stream's
    ids match; missing ones are made."""
    tool = forced_tool(request)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    # Named: the text is the arguments as generated (a stream sent it piece by piece).
    pairs = [(tool.function.name, text)] if tool is not None else [
        (call["name"], json.dumps(call["arguments"])) for call in value]
    while len(ids) < len(pairs):
        ids.append(new_call_id())
    return [ToolCall(id=ids[i], function=FunctionCall(name=name, arguments=arguments))
            for i, (name, arguments) in enumerate(pairs)]
