"""Start several vLLM engines at once, then measure them one at a time.

An engine start (weights, torch.compile, CUDA-graph capture) takes minutes and keeps the
GPU mostly idle; the measurement after it must have the GPU to itself.  A benchmark with
N configurations therefore starts N child processes together, each sized to share GPU
memory (``gpu_memory_fraction``), and lets them measure in turn:

* a child builds its engine and warms it up, then, before each of its measured rounds
  r = 0, 1, ..., calls ``ready_then_wait(gate_dir, name, r)``: it writes
  ``<name>.ready.<r>`` and blocks until ``<name>.go.<r>`` exists;
* the parent (``run_gated``) first waits until *every* child is ready for round 0 (or
  dead): no measurement may share the GPU or the CPUs with another engine's start-up
  (torch.compile, CUDA-graph capture).  The fifth session's KV-tier run released the first
  config while the other two were still capturing graphs, and that config's first repeat
  was its slowest;
* then, round by round and child by child in the given order, it writes the child's go
  and waits until the child is ready for the next round or has exited.  With R rounds the
  measurements interleave (a0 b0 c0 a1 b1 c1 ...), so slow drift of the machine falls on
  every configuration alike.  Idle engines hold memory but issue no GPU work.

A child that dies is reported (``on_done``) and skipped in later rounds.  Pure
file-system protocol, so it is tested on the CPU with plain subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: total fraction of GPU memory the co-resident engines may plan for (vLLM's default 0.9)
TOTAL_GPU_PERCENT = 90


def gpu_memory_fraction(n_engines: int) -> float:
    """floor(0.90 / n) to 2 decimals: each engine's ``gpu_memory_utilization``."""
    if n_engines < 1:
        raise ValueError("need at least one engine")
    return (TOTAL_GPU_PERCENT // n_engines) / 100


def engine_env(work_dir: str, name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one of several engines that start at the same time: its own
    vLLM cache root (torch.compile artifacts), so concurrent compiles never write into
    one cache directory.  ``env``: the base environment (default ``os.environ``)."""
    return dict(os.environ if env is None else env,
                VLLM_CACHE_ROOT=os.path.join(work_dir, f"cache-{name}"))


def ready_then_wait(gate_dir: str, name: str, round_: int = 0, poll_s: float = 0.05,
                    timeout_s: float | None = None) -> None:
    """Child side: announce readiness for measured round ``round_``, then block until
    the parent says go."""
    with open(os.path.join(gate_dir, f"{name}.ready.{round_}"), "w") as f:
        f.write(str(os.getpid()))
    go = os.path.join(gate_dir, f"{name}.go.{round_}")
    t0 = time.monotonic()
    while not os.path.exists(go):
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no go for {name} round {round_} after {timeout_s:.0f} s")
        time.sleep(poll_s)


@dataclass
class GatedChild:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None


def run_gated(children: Sequence[GatedChild], gate_dir: str,
              on_done: Callable[[str, int], None] | None = None,
              poll_s: float = 0.1, log: Callable[[str], None] = print,
              rounds: int = 1, rotate: bool = False) -> dict[str, int]:
    """Start every child at once; once all are ready (or dead), release them one at a
    time, ``rounds`` times over in the given order (each child calls ``ready_then_wait``
    once per round); return each child's exit code.  ``rotate``: round r starts at child
    r mod n (a b c, b c a, c a b, ...), so that no child always runs first or always
    after the same one; with rounds a multiple of n every child takes every place once.
    ``on_done(name, rc)`` runs when a child exits (e.g. to write partial results).
    Children still running when this raises are killed."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    os.makedirs(gate_dir, exist_ok=True)
    procs = {c.name: subprocess.Popen(c.argv, env=c.env) for c in children}
    rcs: dict[str, int] = {}

    def ready(name: str, r: int) -> bool:
        return os.path.exists(os.path.join(gate_dir, f"{name}.ready.{r}"))

    def reap(name: str) -> None:
        if name in rcs:
            return
        rcs[name] = procs[name].wait()
        if rcs[name] != 0:
            log(f"[gate] {name} exited {rcs[name]}")
        if on_done is not None:
            on_done(name, rcs[name])

    try:
        t0 = time.monotonic()
        pending = [c.name for c in children]
        while pending:  # barrier: every start-up is over before anything measures
            for n in list(pending):
                if ready(n, 0):
                    log(f"[gate] {n} ready after {time.monotonic() - t0:.0f} s")
                    pending.remove(n)
                elif procs[n].poll() is not None:
                    pending.remove(n)
            if pending:
                time.sleep(poll_s)
        for c in children:  # children that died during start-up
            if not ready(c.name, 0):
                reap(c.name)
        for r in range(rounds):
            k = r % len(children) if rotate and children else 0
            for c in [*children[k:], *children[:k]]:
                if c.name in rcs:
                    continue
                if not ready(c.name, r):  # it exited during the previous round
                    reap(c.name)
                    continue
                if rounds > 1:
                    log(f"[gate] {c.name} round {r}: go")
                else:
                    log(f"[gate] {c.name}: go")
                with open(os.path.join(gate_dir, f"{c.name}.go.{r}"), "w") as f:
                    f.write("go")
                if r + 1 < rounds:  # its round ends when it is ready for the next one
                    while not ready(c.name, r + 1) and procs[c.name].poll() is None:
                        time.sleep(poll_s)
                    if not ready(c.name, r + 1):
                        reap(c.name)
                else:
                    reap(c.name)
        for c in children:  # a child that asked for fewer rounds than it was given
            reap(c.name)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return rcs
