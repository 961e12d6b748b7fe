"""Named ranges for the KV tier's entry points in a torch-profiler trace.

``traced(name)`` wraps a method so that, while a torch profiler records (vLLM's
``--profiler-config``), each call is a user
annotation ``name`` in the trace: the host time the tier takes per engine step can then be
read beside vLLM's own work.  When no profiler
records, the wrapper costs one attribute read: the tier's entry points run every engine
step, and the wrapper must not add host time to the steps it is meant to explain.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.autograd.profiler as _autograd_profiler
from torch.profiler import record_function


def profiling() -> bool:
    """Whether a torch profiler is recording now (its module flag, read on each call: the
    profiler rebinds it when it starts and stops)."""
    return bool(_autograd_profiler._is_profiler_enabled)


def traced(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _autograd_profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return call

    return wrap
