"""Output constraints asked for over HTTP (response_format, tool_choice, guided_*) -> StructuredOutput, and the
generated text of a tool-calling request -> OpenAI's `tool_calls`.

Tool calls are generated as JSON under a schema built from the tools:
- named (`{"type": "function", "function": {"name": N}}`): the output is N's arguments object itself, constrained by
  its `parameters` schema;
- "required": a list of 1+ calls `[{"name": ..., "arguments": {...}}]` (at most one with parallel_tool_calls false),
  each call constrained by its tool's schema;
- "auto" (OpenAI's default when tools are given): the model decides. Its output is either plain text, which may
  not begin with "<", or TOOL_CALL_TAG followed by the list of calls above; one grammar allows both and nothing
  else, so the first character decides and every call that starts is well-formed. The tools and the format are
  described to the model in the system message (tool_instructions), since a chat template need not know them.
A function whose parameters declare no properties (and do not allow others) takes `{}`: without that, a grammar
over "any object" lets a small model write keys forever.

A call cut by max_tokens or a stop string is returned as what it is: the calls whose names were generated, the
last one with its arguments as far as they got, and finish_reason "length" (or "stop"), never as message content.
fields.judge has checked the combinations before any of this runs.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from specd.sampling.grammar import JSON_LAYOUT
from specd.sampling.params import StructuredOutput
from specd.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    SamplingRequest,
    Tool,
    ToolCall,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
TOOL_CALL_TAG = "<tool_call>"
_CUT_CALL = re.compile(r'\s*,?\s*\{\s*"name":\s*"((?:[^"\\]|\\.)*)"(\s*,\s*"arguments":\s*)?')


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
        return StructuredOutput("json_schema", _parameters(tool), "tools.function.parameters")
    if request.tool_choice == "required" and request.tools:
        return StructuredOutput("json_schema", _calls_schema(request.tools, request.parallel_tool_calls is False),
                                "tools")
    if auto_tools(request):
        assert request.tools is not None
        return StructuredOutput("grammar", _auto_grammar(request.tools, request.parallel_tool_calls is False),
                                "tools")
    return None


def forced_tool(request: ChatCompletionRequest) -> Tool | None:
    """The tool a named tool_choice forces (None for any other choice)."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    return next(t for t in request.tools or [] if t.function.name == choice.function.name)


def auto_tools(request: ChatCompletionRequest) -> bool:
    """tool_choice "auto", given or by default (tools without tool_choice): text or calls, the model decides."""
    return bool(request.tools) and request.tool_choice in (None, "auto")


def calls_tools(request: ChatCompletionRequest) -> bool:
    """Whether the output may be tool calls (named, "required" or "auto"), not only message content."""
    return forced_tool(request) is not None or (request.tool_choice == "required" and bool(request.tools)) \
        or auto_tools(request)


def _parameters(tool: Tool) -> dict[str, Any]:
    schema = tool.function.parameters or _ANY_OBJECT
    if schema.get("properties") == {} and "additionalProperties" not in schema and "patternProperties" not in schema:
        return {**schema, "additionalProperties": False}  # no parameters: the arguments are {}
    return schema


def _calls_schema(tools: list[Tool], single: bool) -> dict[str, Any]:
    call = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def _auto_grammar(tools: list[Tool], single: bool) -> str:
    """Lark (llguidance's dialect): plain text not starting with "<", or the tag and a call list."""
    # The call list laid out as every json_schema constraint is (forced separators draft for free).
    schema = {**_calls_schema(tools, single), "x-guidance": JSON_LAYOUT}
    return (f"start: TEXT | {json.dumps(TOOL_CALL_TAG)} calls\n"
            f"calls: %json {json.dumps(schema)}\n"
            "TEXT: /[^<][\\s\\S]*/\n")


def tool_instructions(request: ChatCompletionRequest) -> str:
    """What an "auto" request tells the model in its system message: the tools and how to call them (short:
    every character is a prompt token)."""
    tools = [{"name": t.function.name, **({"description": t.function.description} if t.function.description
                                          else {}), "parameters": _parameters(t)} for t in request.tools or []]
    how_many = "one call" if request.parallel_tool_calls is False else "calls"
    return ("Functions you can call:\n" + "\n".join(json.dumps(t) for t in tools) + "\n"
            f"To make {how_many}, reply with only {TOOL_CALL_TAG} and a JSON list: "
            '[{"name": NAME, "arguments": {...}}]. Otherwise reply in plain text.')


def with_tool_instructions(messages: list[dict[str, str]], request: ChatCompletionRequest,
                           roles: frozenset[str]) -> list[dict[str, str]]:
    """The conversation with tool_instructions at the end of its first system (or developer) message, or in a new
    one at the front; in front of the first message where the template knows no system role."""
    text = tool_instructions(request)
    out = [dict(m) for m in messages]
    first = out[0] if out else None
    if first is not None and first["role"] in ("system", "developer"):
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
    elif "system" in roles:
        out.insert(0, {"role": "system", "content": text})
    elif first is not None:
        first["content"] = f"{text}\n\n{first['content']}"
    return out


def tool_result_as_user(message: dict[str, str]) -> dict[str, str]:
    """A tool message for a chat template that knows no tool role: a user turn holding the result, marked."""
    return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ParsedCalls(NamedTuple):
    """The tool calls of an output; complete: every call is whole JSON (False: cut by max_tokens or a stop)."""

    calls: list[ToolCall]
    complete: bool


def is_call_text(request: ChatCompletionRequest, text: str) -> bool | None:
    """Whether an output is tool calls: always for named and "required"; for "auto", once its first character
    is known (None before), whether it began the tag."""
    if not auto_tools(request):
        return True
    if not text:
        return None
    return text.startswith("<")


def tool_calls(request: ChatCompletionRequest, text: str, ids: list[str]) -> ParsedCalls | None:
    """The calls in an output (None: an "auto" output that is message content). `ids` are reused in order, so a
    stream's ids match; missing ones are made."""
    if not is_call_text(request, text):
        return None
    tool = forced_tool(request)
    if tool is not None:  # the text is the arguments as generated (a stream sent it piece by piece)
        pairs, complete = [(tool.function.name, text)], _is_json(text)
    else:
        body = text.removeprefix(TOOL_CALL_TAG) if auto_tools(request) else text
        pairs, complete = _call_pairs(body)
    while len(ids) < len(pairs):
        ids.append(new_call_id())
    return ParsedCalls([ToolCall(id=ids[i], function=FunctionCall(name=name, arguments=arguments))
                        for i, (name, arguments) in enumerate(pairs)], complete)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call_pairs(text: str) -> tuple[list[tuple[str, str]], bool]:
    """(name, arguments) of each call in a generated list, and whether the list is complete. A cut list gives the
    calls whose names were generated, the last one's arguments as far as they got."""
    try:
        value = json.loads(text)
        return [(call["name"], json.dumps(call["arguments"])) for call in value], True
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    pairs: list[tuple[str, str]] = []
    at = text.find("[") + 1 if "[" in text else len(text)
    while at < len(text):
        while at < len(text) and text[at] in " ,\n":
            at += 1
        try:
            call, at = decoder.raw_decode(text, at)
        except ValueError:
            cut = _CUT_CALL.match(text, at)
            if cut is not None:  # the name is whole; the arguments, if begun, as far as they got
                pairs.append((json.loads(f'"{cut.group(1)}"'), text[cut.end():] if cut.group(2) else ""))
            break
        pairs.append((call["name"], json.dumps(call["arguments"])))
    return pairs, False
