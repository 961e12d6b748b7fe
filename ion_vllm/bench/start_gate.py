"""Start several vLLM engines at once, then measure them one at a time.

An engine start (weights, torch.compile, CUDA-graph capture) takes minutes and keeps the
GPU mostly idle; the measurement after it must have the GPU to itself.  A benchmark with
N configurations therefore starts N child processes together, each sized to share GPU
memory (``gpu_memory_fraction``), and lets them measure in turn:

* a child builds its engine and warms it up, then calls ``ready_then_wait(gate_dir, name)``:
  it writes ``<name>.ready`` and blocks until ``<name>.go`` exists;
* the parent (``run_gated``) waits for the first child's ``.ready``, writes its ``.go``,
  waits for that child to exit (its engine and GPU memory go with it), then goes on to the
  next child.  Idle engines hold memory but issue no GPU work.

A child that dies before it is ready is reported, not waited for.  Pure file-system
protocol, so it is tested on the CPU with plain subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: total fraction of GPU memory the co-resident engines may plan for (vLLM's default 0.9)
TOTAL_GPU_FRACTION_PCT = 90


def gpu_memory_fraction(n_engines: int) -> float:
    """floor(0.90 / n) to 2 decimals: each engine's ``gpu_memory_utilization``."""
    if n_engines < 1:
        raise ValueError("need at least one engine")
    return (TOTAL_GPU_FRACTION_PCT // n_engines) / 100


def engine_env(work_dir: str, name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one of several engines that start at the same time: its own
    vLLM cache root (torch.compile artifacts), so concurrent compiles never write into
    one cache directory.  ``env``: the base environment (default ``os.environ``)."""
    return dict(os.environ if env is None else env,
                VLLM_CACHE_ROOT=os.path.join(work_dir, f"cache-{name}"))


def ready_then_wait(gate_dir: str, name: str, poll_s: float = 0.05,
                    timeout_s: float | None = None) -> None:
    """Child side: announce readiness, then block until the parent says go."""
    with open(os.path.join(gate_dir, f"{name}.ready"), "w") as f:
        f.write(str(os.getpid()))
    go = os.path.join(gate_dir, f"{name}.go")
    t0 = time.monotonic()
    while not os.path.exists(go):
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no go for {name} after {timeout_s:.0f} s")
        time.sleep(poll_s)


@dataclass
class GatedChild:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None


def run_gated(children: Sequence[GatedChild], gate_dir: str,
              on_done: Callable[[str, int], None] | None = None,
              poll_s: float = 0.1, log: Callable[[str], None] = print) -> dict[str, int]:
    """Start every child at once; release them one at a time, in order; return each
    child's exit code.  ``on_done(name, rc)`` runs after each child exits (e.g. to write
    partial results).  Children still running when this raises are killed."""
    os.makedirs(gate_dir, exist_ok=True)
    procs = {c.name: subprocess.Popen(c.argv, env=c.env) for c in children}
    rcs: dict[str, int] = {}
    try:
        for c in children:
            p = procs[c.name]
            ready = os.path.join(gate_dir, f"{c.name}.ready")
            t0 = time.monotonic()
            while not os.path.exists(ready) and p.poll() is None:
                time.sleep(poll_s)
            if os.path.exists(ready):
                log(f"[gate] {c.name} ready after {time.monotonic() - t0:.0f} s more; go")
                with open(os.path.join(gate_dir, f"{c.name}.go"), "w") as f:
                    f.write("go")
            rcs[c.name] = p.wait()
            if rcs[c.name] != 0:
                log(f"[gate] {c.name} exited {rcs[c.name]}")
            if on_done is not None:
                on_done(c.name, rcs[c.name])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return rcs
