"""The KV tier's profiler ranges (ion_vllm/kv_tier/trace_ranges.py): a named user
annotation while a torch profiler records, nothing at all otherwise."""

import torch
from torch.profiler import ProfilerActivity, profile

from ion_vllm.kv_tier import trace_ranges
from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.worker import IonKVTierWorker


class _Thing:
    def __init__(self):
        self.calls = []

    @trace_ranges.traced("ion_kv:test_step")
    def step(self, x, *, y=0):
        self.calls.append((x, y))
        return torch.ones(4).sum().item() + x + y


#: the prefix every range of the tier carries, so a trace's tier time is one filter away
ION_PREFIX = "ion_kv:"


def _names(prof):
    return [e.name for e in prof.events()]


def test_traced_records_a_range_only_while_profiling(monkeypatch):
    t = _Thing()
    assert not trace_ranges.profiling()
    opened = []
    real = trace_ranges.record_function

    def spy(name):
        opened.append(name)
        return real(name)

    monkeypatch.setattr(trace_ranges, "record_function", spy)
    assert t.step(1, y=2) == 7.0  # no profiler: called through, no range opened
    assert opened == []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert trace_ranges.profiling()
        assert t.step(3) == 7.0
    assert not trace_ranges.profiling()
    assert opened == ["ion_kv:test_step"]
    assert "ion_kv:test_step" in _names(prof)
    assert t.calls == [(1, 2), (3, 0)]
    assert t.step.__name__ == "step"  # functools.wraps


def test_tier_entry_points_carry_the_report_prefix():
    """Every range the tier opens carries the tier's prefix."""
    import inspect

    import ion_vllm.kv_tier.manager as m
    import ion_vllm.kv_tier.worker as w

    names = []
    for mod in (m, w):
        src = inspect.getsource(mod)
        names += [ln.split('"')[1] for ln in src.splitlines() if "@traced(" in ln]
    assert len(names) == 10
    assert all(n.startswith(ION_PREFIX) for n in names)
    for meth in ("submit_store", "submit_load", "get_finished", "wait"):
        assert getattr(IonKVTierWorker, meth).__wrapped__  # the decorator is on it
    for meth in ("prepare_store", "complete_store", "prepare_load", "complete_load",
                 "touch", "get_stats"):
        assert getattr(IonKVTierManager, meth).__wrapped__
