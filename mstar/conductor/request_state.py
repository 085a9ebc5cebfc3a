"""The conductor's per-request state: one owner, one object per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OutputEvent:
    """One value a request emitted, numbered per output name from 0."""

    rid: str
    name: str
    seq: int
    value: Any


@dataclass
class FinishEvent:
    """The request ended: normally (error None), failed (error and status set) or cancelled."""

    rid: str
    finish_reason: str | None
    error: str | None = None
    status: int = 200
    outputs: dict[str, int] = field(default_factory=dict)  # output name -> number of values sent
    streams: dict[str, int] = field(default_factory=dict)  # stream (target input) -> items its finished walks produced


Sink = Callable[[OutputEvent | FinishEvent], None]


@dataclass
class RequestState:
    """Where one request stands: lanes in flight, carries, placement choices, stream counts."""

    rid: str
    inputs: dict[str, Any]  # request inputs by edge name
    options: dict[str, Any]  # per-request model options
    sink: Sink
    carries: dict[str, Any] = field(default_factory=dict)  # walk outputs kept for later walks
    active_lanes: set[str] = field(default_factory=set)
    current_walk: dict[str, str] = field(default_factory=dict)  # lane -> walk in flight
    sticky: dict[str, tuple[int, ...]] = field(default_factory=dict)  # component -> replica chosen
    reserved_routes: dict[str, dict[str, int]] = field(default_factory=dict)  # walk -> node -> rank
    stream_counts: dict[str, int] = field(default_factory=dict)  # stream -> items produced so far
    stream_dest: dict[str, int] = field(default_factory=dict)  # stream -> consumer rank
    workers: set[int] = field(default_factory=set)  # every rank that may hold state of this request
    out_seq: dict[str, int] = field(default_factory=dict)  # output name -> next seq
    finish_reason: str | None = None

    def next_seq(self, name: str) -> int:
        seq = self.out_seq.get(name, 0)
        self.out_seq[name] = seq + 1
        return seq
