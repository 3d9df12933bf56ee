"""The proxy's configuration, and the header that names a request's transfer id."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvpath.credentials import header_safe
from kvpath.proxy.instances import POLICIES
from kvpath.proxy.legs import MODES

# Every answer to a request whose legs were sent carries its transfer id here: the
# X-Request-Id both legs carried (the KV push's id in push mode; in inproc-push vLLM
# names P's request after it). Clients (the testbed) read it instead of parsing ids.
TRANSFER_ID_HEADER: Final = "X-KVPath-Transfer-Id"


@dataclass
class ProxyConfig:
    mode: str = "push"  # one of kvpath.proxy.legs.MODES
    policy: str = "round_robin"
    admin_token: str | None = None
    # sent to the engines as "Authorization: Bearer KEY" (vLLM's --api-key / VLLM_API_KEY)
    # on both legs and GET /v1/models; never shown (repr) or logged
    engine_api_key: str | None = field(default=None, repr=False)
    # Time to a leg's first byte (a non-streamed answer comes whole, so all of it);
    # never the length of a stream, which only the gap between chunks bounds.
    first_byte_timeout_s: float = 300.0
    chunk_gap_timeout_s: float = 60.0
    # TCP connect only (not time queued for a pooled connection). Generous: on a
    # saturated machine the proxy's own event loop can be seconds late to see it.
    connect_timeout_s: float = 15.0
    health_interval_s: float = 2.0  # 0: no health checks
    # Generous for the same reason as connect_timeout_s: a late loop must not
    # take healthy engines out of rotation.
    health_timeout_s: float = 5.0
    unhealthy_after: int = 2
    kv_bytes_per_token: int = 131072  # for the reservation's flow size estimate
    max_connections: int = 2048
    # A client's request body above this is refused (413) before it is read whole: a
    # 128k-token prompt as token ids is about 1 MiB of JSON, images inline a few MiB.
    max_body_bytes: int = 32 * 1024 * 1024

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if min(self.first_byte_timeout_s, self.chunk_gap_timeout_s, self.connect_timeout_s, self.health_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.health_interval_s < 0 or self.unhealthy_after < 1:
            raise ValueError("health_interval_s must be >= 0 and unhealthy_after >= 1")
        key = self.engine_api_key
        if key is not None and not (key and header_safe(key, spaces=True)):
            # a header value: Starlette reads it back as latin-1, vLLM compares UTF-8
            raise ValueError("the engine API key must be one line of printable ASCII")
