"""Spec errors in the words of a spec file: one line naming the field, the value given and
what is allowed (attngen.spec raises them; the CLI prints them)."""

from __future__ import annotations

from typing import Any

from pydantic_core import ErrorDetails


class SpecError(ValueError):
    """A user mistake in a spec file; its message is the one line the CLI prints."""


class FieldError(ValueError):
    """A field that contradicts the others or its allowed values, raised from a validator."""

    def __init__(self, field: str, value: Any, allowed: str, typed: bool = False):
        shown = f"{value!r} ({type(value).__name__})" if typed else repr(value)
        super().__init__(f"{field}: got {shown}; allowed: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def field_error(field: str, value: Any, allowed: str, typed: bool = False) -> FieldError:
    return FieldError(field, value, allowed, typed)


def describe(error: ErrorDetails, allowed_by_field: dict[str, str], known_keys: str) -> str:
    """One pydantic error as 'field: got VALUE; allowed: ...'."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        return str(cause)
    field = ".".join(str(part) for part in error["loc"]) or "spec"
    value = error.get("input")
    kind = error["type"]
    if kind == "missing":
        return f"{field}: missing; required"
    if kind == "extra_forbidden":
        return f"{field}: unknown key (allowed keys: {known_keys})"
    if kind == "enum":
        return f"{field}: got {value!r}; allowed: {error['ctx']['expected']}"
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    allowed = allowed_by_field.get(str(error["loc"][0]) if error["loc"] else "", None)
    return f"{field}: got {shown} ({type(value).__name__}); allowed: " + (
        allowed or _lower_first(error["msg"])
    )


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]
