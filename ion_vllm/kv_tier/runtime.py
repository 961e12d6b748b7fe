"""Streams and events for the KV tier worker: CUDA, or a CPU simulation.

The worker expresses every copy as ``rt.launch(stream, fn)`` and orders work
with events, so the same code runs on CUDA (real asynchronous streams) and on
CPU tensors for tests.  ``SimRuntime`` queues the closures per stream and runs
them only when asked (``step``/``sync``), in random interleavings chosen by
the test; cross-stream ``wait_event`` is honoured.  An ordering bug in the
worker (e.g. a drain issued before its D2D copy) therefore shows up on CPU as
corrupted data.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any, Callable

import torch


class CudaRuntime:
    """CUDA streams and events; every stream the worker makes has the default priority,
    the compute stream's (``torch.cuda.Stream``'s priority 0)."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device, priority=0)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def current_stream(self) -> Any:
        """The current (compute) stream, for work queued in line with the forward pass."""
        return torch.cuda.current_stream(self.device)

    def query(self, event: Any) -> bool:
        return event.query()

    def sync(self, event: Any) -> None:
        event.synchronize()

    def elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3


class _SimEvent:
    __slots__ = ("done", "t")

    def __init__(self):
        self.done = False
        self.t = 0.0


class _SimStream:
    def __init__(self, name: str):
        self.name = name
        self.ops: deque[tuple[str, Any]] = deque()


class SimRuntime:
    """Deterministic CPU stand-in for CUDA streams (see module docstring).

    ``eager=True`` runs every operation at launch (a synchronous device).
    """

    def __init__(self, eager: bool = False):
        self.eager = eager
        self.streams: list[_SimStream] = []
        #: stream name -> how many times it was ordered after the compute stream
        self.current_waits: dict[str, int] = {}
        self._compute: _SimStream | None = None

    def new_stream(self) -> _SimStream:
        s = _SimStream(f"s{len(self.streams)}")
        self.streams.append(s)
        return s

    def _push(self, stream: _SimStream, op: tuple[str, Any]) -> None:
        stream.ops.append(op)
        if self.eager:
            self._run_stream(stream)

    def launch(self, stream: _SimStream, fn: Callable[[], None]) -> None:
        self._push(stream, ("fn", fn))

    def record(self, stream: _SimStream) -> _SimEvent:
        ev = _SimEvent()
        self._push(stream, ("rec", ev))
        return ev

    def wait_event(self, stream: _SimStream, event: _SimEvent) -> None:
        self._push(stream, ("wait", event))

    def wait_current(self, stream: _SimStream) -> None:
        # Host-side test code produces KV data synchronously; only counted, so tests can
        # check which copies are ordered after the compute stream.
        self.current_waits[stream.name] = self.current_waits.get(stream.name, 0) + 1

    def current_stream(self) -> _SimStream:
        """A simulated stream standing for the compute stream, for work queued on it
        (made on first use; its queued work runs in the same random interleavings as the
        other streams').  The KV data the tests write is still produced by the host."""
        if self._compute is None:
            self._compute = _SimStream("compute")
            self.streams.append(self._compute)
        return self._compute

    def query(self, event: _SimEvent) -> bool:
        return event.done

    def sync(self, event: _SimEvent) -> None:
        while not event.done:
            owner = self._owner(event)
            assert owner is not None, "waiting on an event that was never recorded"
            self._run_one(owner)

    def elapsed(self, start: _SimEvent, end: _SimEvent) -> float:
        return max(end.t - start.t, 1e-9)

    # -- execution
    def _owner(self, event: _SimEvent) -> _SimStream | None:
        for s in self.streams:
            for kind, payload in s.ops:
                if kind == "rec" and payload is event:
                    return s
        return None

    def _run_one(self, s: _SimStream) -> None:
        kind, payload = s.ops[0]
        if kind == "wait" and not payload.done:
            self.sync(payload)
        s.ops.popleft()
        if kind == "fn":
            payload()
        elif kind == "rec":
            payload.done = True
            payload.t = time.perf_counter()

    def _run_stream(self, s: _SimStream) -> None:
        while s.ops:
            self._run_one(s)

    def step(self, rng: random.Random, max_ops: int) -> None:
        """Run up to max_ops queued operations, picking streams at random."""
        for _ in range(max_ops):
            busy = [s for s in self.streams if s.ops]
            if not busy:
                return
            self._run_one(rng.choice(busy))

    def run_all(self) -> None:
        for s in self.streams:
            self._run_stream(s)

    @property
    def pending_ops(self) -> int:
        return sum(len(s.ops) for s in self.streams)
