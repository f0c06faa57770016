"""Errors that name the offending field, shared by every entry point (CLI, Python API, HTTP)."""

from __future__ import annotations


class SpecdError(Exception):
    """Base class of every error specd raises on purpose."""


class InvalidParameterError(SpecdError, ValueError):
    """A user-supplied value is invalid. `field` names it so HTTP can answer 400 with `param`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def require_int(field: str, value: object, lo: int = 1) -> None:
    """Raise InvalidParameterError naming `field` unless `value` is an int (not a bool) >= lo."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidParameterError(field, f"must be an integer >= {lo}, got {value!r}")


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            "prompt",
            f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class QueueFullError(SpecdError):
    """The waiting queue is at its configured limit; the caller should retry later (after `retry_after_s`
    seconds, when the raiser could estimate it)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(SpecdError):
    """A model path, file or name could not be loaded."""
