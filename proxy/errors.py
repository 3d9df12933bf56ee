"""Turning pydantic validation errors into the 4xx answers the services give."""

from __future__ import annotations

from typing import Any, Sequence


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, list[str]]:
    """('field: message; ...', [field, ...]) naming each bad field; FastAPI's
    leading 'body' is dropped and a whole-body error is named 'body'."""
    fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in errors]
    msg = "; ".join(f"{f or 'body'}: {e.get('msg')}" for f, e in zip(fields, errors))
    return msg, fields


def is_invalid_json(errors: Sequence[Any]) -> bool:
    return any(e.get("type") == "json_invalid" for e in errors)
