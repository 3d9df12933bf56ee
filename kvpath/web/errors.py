"""The error answers of the proxy and the reservation service, and validation errors
(pydantic's, msgspec's) turned into 4xx answers that name the field."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import msgspec
from starlette.responses import JSONResponse


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, list[str]]:
    """('field: message; ...', [field, ...]) naming each bad field; FastAPI's
    leading 'body' is dropped and a whole-body error is named 'body'."""
    fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in errors]
    msg = "; ".join(f"{f or 'body'}: {e.get('msg')}" for f, e in zip(fields, errors))
    return msg, fields


def is_invalid_json(errors: Sequence[Any]) -> bool:
    return any(e.get("type") == "json_invalid" for e in errors)


_AT_MARK = " - at `$"
_MAX_TEXT = 200  # msgspec repeats the bad value: a hostile body must not come back whole
_MISSING = re.compile(r"missing required field `([^`]+)`")


def describe_msgspec_error(e: msgspec.ValidationError) -> tuple[str, list[str]]:
    """The same ('field: message', [field]) for msgspec, which stops at the first error:
    ``Expected `int` >= 0 - at `$.lanes[0].src_port``` names ``lanes.0.src_port``."""
    raw = str(e)
    # the location is the last mark: the value quoted before it may contain one
    text, mark, at = raw.rpartition(_AT_MARK)
    if mark and at.endswith("`"):
        at = at[:-1]
    else:
        text, at = raw, ""
    if len(text) > _MAX_TEXT:
        text = text[:_MAX_TEXT] + "..."
    parts = [p for p in re.split(r"[.\[\]]+", at) if p]
    missing = _MISSING.search(text)
    if missing:
        parts.append(missing.group(1))
    field = ".".join(parts)
    return f"{field or 'body'}: {text}", [field]


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    """The proxy's own error answer, in the OpenAI shape: ``{"error": {"message", "code", ...}}``."""
    return JSONResponse({"error": {"message": message, "code": status, **extra}}, status_code=status,
                        headers=dict(headers) if headers else None)
