"""The worker's lean issue path (``issue_api="raw"``, ion_vllm/kv_tier/raw_issue.py) on
the CPU: the run splitting and address arithmetic of its pointer drain (executed with
memmove, byte for byte against the torch copier), its id staging buffers (reuse only
after the reading launch's event), and the whole worker on it under the randomized
store/evict/load/preempt harness with simulated streams.  The CUDA side (compiled
launchers, cudaMemcpyAsync) is checked by tests/test_kv_tier_gpu.py."""

import numpy as np
import pytest
import torch

from ion_vllm.kv_tier.raw_issue import HostMemmove, IdStage, PointerDrain, load_cudart, runs
from ion_vllm.kv_tier.testing import run_random_ops
from ion_vllm.kv_tier.worker import TorchCopier


def _runs_reference(a, b):
    out = []
    i = 0
    while i < len(a):
        j = i + 1
        while j < len(a) and a[j] == a[i] + (j - i) and b[j] == b[i] + (j - i):
            j += 1
        out.append((a[i], b[i], j - i))
        i = j
    return out


@pytest.mark.parametrize("seed,sizes", [(0, (0, 12)), (1, (0, 12)), (2, (0, 12)),
                                        (3, (0, 12)), (4, (50, 200))])
def test_runs_match_a_reference_split(seed, sizes):
    """Both walks (Python up to RUNS_PY_MAX positions, numpy beyond: the last case)."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(*sizes))
        a = (np.cumsum(rng.integers(1, 3, n)) + int(rng.integers(0, 5))).tolist()
        b = (np.cumsum(rng.choice([1, 1, 1, 2, -3], n)) + 20).tolist()
        got = runs(a, b)
        assert [(a0, b0, i1 - i0) for i0, i1, a0, b0 in got] == _runs_reference(a, b)
        # the runs tile the positions in order
        assert [i0 for i0, _, _, _ in got] == [0, *(i1 for _, i1, _, _ in got)][:len(got)]
        assert sum(i1 - i0 for i0, i1, _, _ in got) == n
        assert runs(np.asarray(a), np.asarray(b)) == got  # the worker passes arrays


def _buffers(rng, layout, rows=9):
    pages = [512, 1536, 256]
    ts = [torch.zeros(4, p, dtype=torch.int8) for p in pages]
    offs = [int(x) for x in np.cumsum([0] + pages[:-1])]
    cp = TorchCopier(ts, offs, [[(t, p) for t, p in enumerate(pages)]], layout=layout,
                     page_bytes=pages)
    ring = torch.from_numpy(rng.integers(-128, 128, (7, sum(pages)), dtype=np.int8))
    host = torch.from_numpy(rng.integers(-128, 128, (rows, sum(pages)), dtype=np.int8))
    return pages, cp, ring, host


@pytest.mark.parametrize("layout", ["slot", "tensor"])
def test_pointer_drain_matches_the_torch_copier(layout):
    """Random ring runs into random host rows (consecutive and not): the pointer copies
    leave the host buffer exactly as the torch copier's drain does."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        pages, cp, ring, host = _buffers(rng, layout)
        ref = host.clone()
        n = int(rng.integers(1, 6))
        start = int(rng.integers(0, 7 - n + 1))
        if rng.random() < 0.5:  # one consecutive run
            h0 = int(rng.integers(0, 9 - n + 1))
            hids = np.arange(h0, h0 + n)
        else:
            hids = rng.choice(9, n, replace=False)
        PointerDrain(ring, host, layout, cp.placement, pages, HostMemmove())(
            start, hids.tolist(), None)
        cp.drain(ring, start, ref, hids)
        assert torch.equal(host, ref), (layout, trial, start, hids)


class CountingMemmove(HostMemmove):
    """HostMemmove that appends each copy's size to ``sizes``."""

    def __init__(self, sizes: list):
        self.sizes = sizes

    def copy(self, dst, src, nbytes, stream):
        self.sizes.append(nbytes)
        super().copy(dst, src, nbytes, stream)


def test_pointer_drain_copies_a_consecutive_run_in_one_call():
    """A run of consecutive ring and host rows is one copy per region (slot layout: one),
    not one per row; a broken run is one copy per piece."""
    rng = np.random.default_rng(1)
    calls = []

    pages, cp, ring, host = _buffers(rng, "slot")
    PointerDrain(ring, host, "slot", cp.placement, pages, CountingMemmove(calls))(
        2, [4, 5, 6], None)
    assert calls == [3 * sum(pages)]
    calls.clear()
    pages, cp, ring, host = _buffers(rng, "tensor")
    PointerDrain(ring, host, "tensor", cp.placement, pages, CountingMemmove(calls))(
        2, [4, 5, 1], None)
    assert sorted(calls) == sorted([2 * p for p in pages] + pages)


class _Ev:
    def __init__(self):
        self.done = False


def read_ids(addr: int, n: int) -> np.ndarray:
    """``n`` int64 ids read back from host address ``addr``."""
    import ctypes

    out = np.empty(n, dtype=np.int64)
    ctypes.memmove(out.ctypes.data, addr, 8 * n)
    return out


def put_while_pending(stage, rng, lo: int, hi: int, puts: int = 8):
    """``puts`` puts of 1-5 random ids into ``stage``, each held by an event left pending:
    every put's address (16-byte aligned) holds its ids; returns the (event, address, ids)
    of each and whether each address fell inside [lo, hi)."""
    events, in_buf = [], []
    for _ in range(puts):
        ids = rng.integers(0, 1000, int(rng.integers(1, 6)))
        addr = stage.put(ids, "S")
        assert addr % 16 == 0 and np.array_equal(read_ids(addr, len(ids)), ids)
        in_buf.append(lo <= addr < hi)
        ev = _Ev()
        stage.hold(ev)
        events.append((ev, addr, ids))
    return events, in_buf


def test_id_stage_copies_ids_and_reuses_a_region_only_after_its_event():
    """Each put lands the ids at the returned address (read back through it); while the
    events of earlier puts are pending the buffer runs out and puts fall back to fresh
    tensors (still correct, kept alive until their event), and once those events complete
    the buffer is used again."""
    rng = np.random.default_rng(3)
    stage = IdStage(torch.device("cpu"), HostMemmove(), capacity=16, done=lambda e: e.done)
    lo, hi = stage.buf.data_ptr(), stage.buf.data_ptr() + 8 * 16
    events, in_buf = put_while_pending(stage, rng, lo, hi)
    assert stage.fallbacks > 0 and stage.staged > 0
    assert in_buf[0] and not in_buf[-1]
    # nothing pending was overwritten, in the buffer or in a fallback tensor
    for ev, addr, ids in events:
        assert np.array_equal(read_ids(addr, len(ids)), ids)
    for ev, _, _ in events:
        ev.done = True
    staged = stage.staged
    addr = stage.put(np.arange(4), None)
    stage.hold(_Ev())
    assert stage.staged == staged + 1 and lo <= addr < hi
    assert not stage._spare or all(not ev.done for _, ev in stage._spare)


@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("overflow,completion,seed", [("direct", "read", 31),
                                                      ("defer", "host", 32)])
def test_random_ops_raw_issue(host_layout, overflow, completion, seed):
    """The worker on issue_api="raw" (drains as pointer copies, memmove on the CPU) under
    the randomized harness with random stream interleavings: every restored block
    byte-identical to the block stored."""
    r = run_random_ops(seed, 6000, overflow=overflow, completion=completion,
                       host_layout=host_layout, issue_api="raw")
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0 and r.worker_stats["drained_blocks"] > 0


def test_raw_drain_mutant_is_caught():
    """A pointer drain that copies one row short of each run corrupts restored blocks,
    and the harness says so (the test above can fail)."""
    from ion_vllm.kv_tier.testing import Corruption
    import ion_vllm.kv_tier.raw_issue as ri

    orig = ri.runs

    def short(a, b):
        return [(i0, max(i0 + 1, i1 - 1), x, y) for i0, i1, x, y in orig(a, b)]

    ri.runs = short
    try:
        with pytest.raises((Corruption, AssertionError)):
            run_random_ops(33, 3000, issue_api="raw")
    finally:
        ri.runs = orig


def test_unknown_issue_api_is_refused():
    with pytest.raises(ValueError, match="issue_api"):
        run_random_ops(1, 10, issue_api="cuda")


def test_the_cuda_runtime_library_opens_where_torch_has_cuda():
    if not torch.version.cuda:
        pytest.skip("a CPU-only PyTorch build has no CUDA runtime")
    lib = load_cudart()
    assert hasattr(lib, "cudaMemcpyAsync") and hasattr(lib, "cudaGetErrorString")


def test_raw_without_the_runtime_library_falls_back_to_torch_and_says_so(monkeypatch, caplog):
    """When the raw path's copy function cannot be built (no CUDA runtime library to
    open), the worker logs it and issues through PyTorch; it still stores and restores
    every block intact."""
    import logging

    from ion_vllm.kv_tier import worker as W

    def no_library():
        raise OSError("libcudart.so: cannot open shared object file")

    monkeypatch.setattr(W, "HostMemmove", no_library)
    seen = []

    class Spy(W.IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append((self.issue_api, self._ptr_drain))

    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        r = run_random_ops(5, 800, worker_cls=Spy, issue_api="raw")
    assert seen == [("torch", None)]
    assert "issuing through PyTorch instead" in caplog.text
    assert r.restored_blocks > 0


def test_a_compiled_kernel_without_a_launcher_is_left_to_the_dispatcher(caplog):
    """A Triton whose compiled kernels lack what the compiled launcher calls: logged, no
    launcher kept (the kernel then goes through Triton's dispatcher); nothing under the
    interpreter (a launch returns None there)."""
    import logging

    from ion_vllm.kv_tier.page_gather import _compiled_launch

    assert _compiled_launch(None, "ring gather") is None
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.page_gather"):
        assert _compiled_launch(object(), "ring gather") is None
    assert "ring gather" in caplog.text and "no launcher" in caplog.text
