"""The admin token check shared by the proxy and the reservation service."""

from __future__ import annotations

import hmac


def bearer_ok(authorization: str | None, token: str | None) -> bool:
    """True when ``authorization`` is ``Bearer <token>``. Constant time, so the
    answer's timing does not tell how much of a guess was right. No token: False."""
    if not token:
        return False
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes sent
    got = (authorization or "").encode("latin-1", errors="replace")
    return hmac.compare_digest(got, b"Bearer " + token.encode("utf-8"))
