"""What the scheduler side hands each worker per step (no vLLM import, so that tools
and benchmarks can build it without loading vLLM's KV connector package).

:class:`~kvpath.connector.vllm_scheduler.KVPathMetadata` is these commands as vLLM's
``KVConnectorMetadata``; vLLM broadcasts it to every TP worker with the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecvReq:
    request_id: str
    transfer_id: str
    peer: str
    block_ids: list[int]
    skip_blocks: int
    peer_key: str | None = None
    transfer_key: str = ""
    p_tp_size: int = 0  # P's TP size from the D leg's kv_transfer_params (0: as D's)


@dataclass
class PushReq:
    """A P request whose KV is pushed: its blocks, the lane and lease it came with, its key."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    lane: int | None
    lease_id: str | None = None
    transfer_key: str = ""


@dataclass
class SendReq(PushReq):
    """A P request that finished: its push goes whole, or commits a begun one."""

    # vLLM's own times of the P request (unix s; None without vLLM's stats): it reached
    # the engine, entered the queue, was first scheduled (kvpath.request_timeline)
    times: "VllmTimes | None" = None


@dataclass
class ComputeReq(PushReq):
    """A begun push's part in one forward: the request's blocks so far; the tokens whose
    KV was final before this forward (whole blocks) and will be after it (None: this
    forward completes the prompt, whose layers are pushed as they are computed)."""

    final_before: int = 0
    final_after: int | None = None
    first: bool = True  # the push's first forward (it begins; later ones feed it)

    @property
    def last(self) -> bool:
        return self.final_after is None


@dataclass(frozen=True)
class VllmTimes:
    arrival_at: float | None = None
    queued_at: float | None = None
    scheduled_at: float | None = None

    def record_fields(self) -> dict[str, float | None]:
        """As the TransferRecord's fields."""
        return {"p_arrival_at": self.arrival_at, "p_queued_at": self.queued_at, "p_scheduled_at": self.scheduled_at}


@dataclass
class StepCommands:
    registrations: list[RecvReq] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # D request ids
    finished: list[SendReq] = field(default_factory=list)
    # push_granularity layer or chunk: P requests this step's forward computes a part of
    # whose push is begun (layer: the last chunk only; chunk: every chunk); ``finished``
    # later commits it
    computing: list[ComputeReq] = field(default_factory=list)
    # begun P requests that ended without finishing: (request id, transfer id)
    aborted_begun: list[tuple[str, str]] = field(default_factory=list)
    # begun P requests vLLM preempted (their blocks are freed): (request id, transfer id)
    restarts: list[tuple[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # P transfer ids
    idle: bool = False  # the step runs no model: it exists only for the connector's work
