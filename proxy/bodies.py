"""The request bodies the proxy validates (pydantic): the two inference endpoints'
(only what the proxy relies on; every other field passes through to the engines)
and the admin endpoint's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # the engines validate the rest


class CompletionBody(_Open):
    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    stream: bool = Field(default=False, strict=True)


class ChatBody(_Open):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    stream: bool = Field(default=False, strict=True)


# the inference endpoints and their bodies
INFERENCE: dict[str, type[BaseModel]] = {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody}


class InstanceBody(BaseModel):
    role: str = Field(pattern="^(prefill|decode)$")
    url: str = Field(min_length=8, pattern="^https?://")
    fabric_host: str = ""
    kv_addr: str = ""
    engine_id: str = ""
    # P's TP size where it differs from D's (push mode: D's ranks then register with
    # the P ranks that hold their heads); 0: not given, D takes it to be its own
    tp_size: int = Field(0, ge=0, le=1024)
