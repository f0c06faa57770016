"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to one APIError here, so handlers raise and one exception
handler writes the body. `param` names the request field at fault whenever there is one.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from specd.errors import InvalidParameterError, PromptTooLongError, QueueFullError
from specd.server.protocol import ErrorBody, ErrorInfo


class APIError(Exception):
    """A failed request: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)
        self.headers = dict(headers or {})

    def body(self) -> ErrorBody:
        return ErrorBody(error=self.info)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: Exception, rename: Mapping[str, str] | None = None) -> APIError:
    """Map what `LLM.add_request` raises to a status; `rename` turns engine field names into request ones."""
    rename = rename or {}
    if isinstance(exc, PromptTooLongError):
        field = rename.get(exc.field, exc.field)
        return APIError(400, f"{field}: {exc.message}", param=field, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        field = rename.get(exc.field, exc.field)
        return APIError(400, f"{field}: {exc.message}", param=field, code="invalid_value")
    if isinstance(exc, QueueFullError):
        # 503 + Retry-After (not 429): the server is saturated, the client did nothing wrong.
        retry_after_s = max(1, exc.retry_after_s or 1)
        return APIError(
            503, f"{exc}; retry in {retry_after_s}s", error_type="service_unavailable_error", code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
        )
    return APIError(500, f"{type(exc).__name__}: {exc}", error_type="server_error", code="internal_error")


class Offense(NamedTuple):
    """One field of a request that specd cannot honour: where, why and the OpenAI error code."""

    param: str | None
    message: str  # without the field name (it is prefixed when written)
    code: str


def invalid_request(offenses: Sequence[Offense]) -> APIError:
    """One 400 naming every offending field: `param` is the first, the message lists them all."""
    if not offenses:
        raise ValueError("invalid_request needs at least one offense")
    parts = [f"{o.param}: {o.message}" if o.param else o.message for o in offenses]
    first = offenses[0]
    if len(offenses) == 1:
        return bad_request(parts[0], first.param, code=first.code)
    names = ", ".join(o.param or "body" for o in offenses)
    return bad_request(f"{len(offenses)} fields cannot be honoured ({names}): " + "; ".join(parts), first.param,
                       code=first.code)


# The depth pydantic's JSON parser reads (the body's own object counted); deeper JSON fails as "recursion limit".
MAX_JSON_DEPTH = 200


def from_validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """Every pydantic error in one 400, each with `param` as a dotted path of request fields (`messages[0].content`)."""
    return invalid_request(validation_offenses(exc, model))


def validation_offenses(exc: ValidationError, model: type[BaseModel]) -> list[Offense]:
    """The pydantic errors as offenses, one per field (a union field's members report one error each). Malformed
    JSON raises at once: nothing else can be said about such a body."""
    out: list[Offense] = []
    for error in exc.errors(include_url=False):
        offense = _offense(error["type"], tuple(error["loc"]), error["msg"], model)
        if offense.code in ("invalid_json", "json_too_deep"):
            raise bad_request(offense.message, None, code=offense.code)
        if all(o.param != offense.param for o in out):
            out.append(offense)
    return out


def _offense(kind: str, loc: tuple[int | str, ...], msg: str, model: type[BaseModel]) -> Offense:
    if kind == "json_invalid" and "recursion limit" in msg:  # valid JSON, but past the parser's depth
        return Offense(None, f"the JSON body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep, the "
                       f"parser's limit ({msg})", "json_too_deep")
    if kind == "json_invalid":
        return Offense(None, f"malformed JSON body: {msg}", "invalid_json")
    if kind == "extra_forbidden":
        param = _join(loc)
        return Offense(param, "unsupported field: specd does not implement it (it is rejected rather than ignored)",
                       "unsupported_parameter")
    if not loc:
        return Offense(None, f"request body: {msg}", "invalid_type")
    param, union_field = _param_path(model, loc)
    if union_field is not None and union_field.description:
        # pydantic reports one error per union member ("should be a valid string" for the first); what the
        # client needs is the list of shapes the field accepts.
        return Offense(param, f"must be {union_field.description}", "invalid_type")
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    else:  # a constraint such as n >= 1 or a literal
        code = "invalid_value"
    return Offense(param, msg, code)


def _join(loc: Sequence[int | str]) -> str:
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out


def _param_path(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str, FieldInfo | None]:
    """Follow `loc` through the model's fields; stop at the first part that is not a field (pydantic's
    union-member labels such as 'list[str]', which mean nothing to a client). Returns the dotted path and,
    when the error is inside a union-typed field, that field (its description lists what it accepts)."""
    current: type[BaseModel] | None = model
    kept: list[int | str] = []
    field: FieldInfo | None = None
    for item in loc:
        if isinstance(item, int):
            kept.append(item)
            continue
        if current is None or item not in current.model_fields:
            return _join(kept) or str(loc[0]), field
        kept.append(item)
        field = current.model_fields[item]
        current = _submodel(field.annotation)
    return _join(kept) or str(loc[0]), None


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `list[ChatMessage] | None`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return None
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None
