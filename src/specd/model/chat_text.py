"""Where client text sits in a rendered chat prompt, and which roles a chat template knows.

A chat template interleaves its own control tokens (`<|im_start|>`, `<|im_end|>`) with message contents. If
the contents were tokenized together with the template's text, a client could write `<|im_end|>` in a
message and get the real control token, forging turns. These helpers let the tokenizer tell the two apart:
`content_spans` finds each content's characters in the rendered prompt, `template_roles` the roles a template
mentions (so a role string cannot smuggle control text into the prompt either).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence

from jinja2 import nodes

# Every chat template is written for these; a template may name more (tool, ipython, developer...).
STANDARD_ROLES = frozenset({"system", "user", "assistant"})

# Private-use code points never appear in a template's own text, and the nonce makes the marker unguessable.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def template_roles(template: nodes.Template) -> frozenset[str]:
    """STANDARD_ROLES plus every string a template compares a role with (`message['role'] == 'tool'`,
    `message.role in ['user', 'ipython']`)."""
    roles = set(STANDARD_ROLES)
    for compare in template.find_all(nodes.Compare):
        operands = [compare.expr, *(operand.expr for operand in compare.ops)]
        if not any(_mentions_role(operand) for operand in operands):
            continue
        for operand in operands:
            roles.update(_string_constants(operand))
    return frozenset(roles)


def _mentions_role(node: nodes.Node) -> bool:
    candidates = [node, *node.find_all((nodes.Getitem, nodes.Getattr, nodes.Name))]
    for candidate in candidates:
        if isinstance(candidate, nodes.Getitem) and isinstance(candidate.arg, nodes.Const):
            if candidate.arg.value == "role":
                return True
        elif isinstance(candidate, nodes.Getattr) and candidate.attr == "role":
            return True
        elif isinstance(candidate, nodes.Name) and "role" in candidate.name:
            return True
    return False


def _string_constants(node: nodes.Node) -> list[str]:
    if isinstance(node, nodes.Const):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, (nodes.List, nodes.Tuple)):
        return [item.value for item in node.items if isinstance(item, nodes.Const) and isinstance(item.value, str)]
    return []


def content_spans(
    render: Callable[[list[dict[str, str]]], str], messages: Sequence[dict[str, str]], rendered: str
) -> list[tuple[int, int]] | None:
    """Character spans `(start, end)` of the message contents inside `rendered` (= `render(messages)`), in
    order of appearance; None if the template does not copy contents verbatim (it trims, escapes or branches
    on them), when where client text ends cannot be known.

    Renders once more with each content replaced by a unique marker, then puts the contents back in place of
    the markers: if that reproduces `rendered` exactly, the places the markers took are the contents' spans.
    """
    nonce = secrets.token_hex(8)
    marked_messages = [{**m, "content": f"{_MARK_OPEN}{nonce}:{i}{_MARK_CLOSE}"} for i, m in enumerate(messages)]
    try:
        marked = render(marked_messages)
    except ValueError:  # InvalidParameterError: the template rejected the markers (it inspects contents)
        return None
    pattern = re.compile(re.escape(_MARK_OPEN + nonce) + r":(\d+)" + re.escape(_MARK_CLOSE))
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0
    previous_end = 0
    for match in pattern.finditer(marked):
        template_text = marked[previous_end:match.start()]
        content = messages[int(match.group(1))]["content"]
        pieces += [template_text, content]
        length += len(template_text)
        spans.append((length, length + len(content)))
        length += len(content)
        previous_end = match.end()
    pieces.append(marked[previous_end:])
    return spans if "".join(pieces) == rendered else None


def overlaps(offsets: tuple[int, int], spans: Sequence[tuple[int, int]]) -> bool:
    """Whether the character range `offsets` shares at least one character with any of `spans`."""
    start, end = offsets
    return any(start < span_end and end > span_start for span_start, span_end in spans)
