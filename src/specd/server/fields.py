"""OpenAI request fields judged by value: a neutral value is a no-op, metadata is accepted and reported, and a value
specd cannot honour is an offense (all of a request's offenses make one 400, see errors.invalid_request).

The judge reads the decoded JSON body, before and independently of pydantic, so a request with an unknown field and
an unhonourable value hears about both at once. It only looks at values of the right JSON type: a wrong type is
pydantic's to report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from specd.server.errors import Offense

# Fields that describe the request but never change its output (OpenAI's store/metadata/tiers, caching hints).
METADATA_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")
MESSAGE_NAME_FIELD = "messages[].name"
# Fields that each ask for an output constraint; one request may carry one.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class Judgement(NamedTuple):
    offenses: list[Offense]
    ignored: list[str]  # metadata fields present in the request (for the x-specd-ignored-fields header)


def judge(body: object, chat: bool) -> Judgement:
    """Offenses and ignored metadata of a decoded request body (anything but an object yields neither)."""
    if not isinstance(body, Mapping):
        return Judgement([], [])
    offenses: list[Offense] = []
    ignored = [name for name in METADATA_FIELDS if body.get(name) is not None]
    if chat:
        offenses += _judge_tools(body)
        offenses += _judge_response_format(body.get("response_format"))
        messages = body.get("messages")
        if isinstance(messages, list):
            message_offenses, named = _judge_messages(messages)
            offenses += message_offenses
            if named:
                ignored.append(MESSAGE_NAME_FIELD)
    else:
        offenses += _judge_completion(body)
    offenses += _judge_constraint_count(body, chat)
    return Judgement(offenses, ignored)


def _judge_completion(body: Mapping[str, Any]) -> list[Offense]:
    out: list[Offense] = []
    best_of = body.get("best_of")
    if isinstance(best_of, int) and not isinstance(best_of, bool) and best_of != 1:
        out.append(Offense("best_of", f"only 1 (or null) is supported, got {best_of}: specd returns every sampled "
                           "choice rather than the best of several (ask for them with n)", "unsupported_value"))
    suffix = body.get("suffix")
    if isinstance(suffix, str) and suffix:
        out.append(Offense("suffix", "only null or \"\" is supported: specd does not insert text before a suffix "
                           "(fill-in-the-middle)", "unsupported_value"))
    return out


def tool_choice_of(body: Mapping[str, Any]) -> object:
    """The effective tool_choice: OpenAI's default is "auto" with tools and "none" without."""
    choice = body.get("tool_choice")
    if choice is not None:
        return choice
    return "auto" if body.get("tools") else "none"


def _judge_tools(body: Mapping[str, Any]) -> list[Offense]:
    tools = body.get("tools")
    names = [t["function"].get("name") for t in tools or [] if isinstance(t, Mapping)
             and isinstance(t.get("function"), Mapping)] if isinstance(tools, list) else []
    out: list[Offense] = []
    duplicates = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if duplicates:
        out.append(Offense("tools", f"function names must be unique; repeated: {', '.join(duplicates)}",
                           "invalid_value"))
    choice = tool_choice_of(body)
    if choice == "required" and not names:
        out.append(Offense("tool_choice", '"required" needs a non-empty tools list', "invalid_value"))
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if isinstance(name, str) and name not in names:
            out.append(Offense("tool_choice.function.name", f"'{name}' is not one of the tools ("
                               f"{', '.join(str(n) for n in names) or 'none given'})", "invalid_value"))
    return out


def _judge_response_format(response_format: object) -> list[Offense]:
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema" \
            and response_format.get("json_schema") is None:
        return [Offense("response_format.json_schema", 'is required when type is "json_schema"',
                        "missing_required_parameter")]
    return []


def _judge_messages(messages: list[object]) -> tuple[list[Offense], bool]:
    """Offenses of the messages, and whether any carries a `name` (metadata)."""
    out: list[Offense] = []
    named = False
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        named = named or message.get("name") is not None
        assistant = message.get("role") == "assistant"
        if "content" in message and message["content"] is None and not assistant:
            out.append(Offense(f"messages[{i}].content", "may be null only in an assistant message",
                               "invalid_value"))
        if message.get("content") == [] and not assistant:
            out.append(Offense(f"messages[{i}].content", "must not be an empty list: send at least one text part",
                               "invalid_value"))
        if "content" not in message and not assistant:
            out.append(Offense(f"messages[{i}].content", "is required (except in an assistant message)",
                               "missing_required_parameter"))
        if message.get("tool_calls") and not assistant:
            out.append(Offense(f"messages[{i}].tool_calls", "only an assistant message makes tool calls",
                               "invalid_value"))
    return out, named


def constraint_sources(body: Mapping[str, Any], chat: bool) -> list[str]:
    """The fields of a request that ask for an output constraint (more than one is an offense)."""
    sources = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if chat:
        response_format = body.get("response_format")
        if isinstance(response_format, Mapping) and response_format.get("type") in ("json_object", "json_schema"):
            sources.append("response_format")
        choice = tool_choice_of(body)
        if choice == "required" or isinstance(choice, Mapping) or (choice == "auto" and body.get("tools")):
            sources.append("tool_choice")
    return sources


def _judge_constraint_count(body: Mapping[str, Any], chat: bool) -> list[Offense]:
    sources = constraint_sources(body, chat)
    return [Offense(name, f"only one output constraint per request: {sources[0]} already constrains it",
                    "invalid_value") for name in sources[1:]]
