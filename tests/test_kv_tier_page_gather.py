"""The GPU -> ring gather kernel (ion_vllm/kv_tier/page_gather.py) on the CPU, through
Triton's interpreter: its addressing against the torch copier's gather, and inside the
worker under the randomized store/evict/load/preempt harness.  The interpreter is
chosen when the kernel is defined, so these run in a subprocess."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: KV pages both kernels are checked on: 3 tensors of NB blocks with pages of different
#: sizes (one > CHUNK_BYTES: several chunks per page, and not a multiple of it), GPU row
#: stride > page (padded rows), 2 KV groups (the second copying a prefix of tensor 2's page)
PAGES = """
    import numpy as np, torch
    from ion_vllm.kv_tier.page_gather import CHUNK_BYTES
    from ion_vllm.kv_tier.worker import TorchCopier
    NB = 12
    pages = [4096, CHUNK_BYTES + 2048, 1024]
    ts = [torch.randint(-128, 128, (NB, p + 64 * k), dtype=torch.int8)
          for k, p in enumerate(pages)]
    offs = [int(x) for x in np.cumsum([0] + pages[:-1])]
    refs = [[(0, pages[0]), (1, pages[1])], [(2, 512)]]
"""


def _interpret(code: str, prelude: str = "") -> str:
    src = textwrap.dedent(prelude) + textwrap.dedent(code)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", src], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_kernel_matches_the_torch_gather_in_both_ring_layouts():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import PageGather
        rng = np.random.default_rng(7)
        for layout in ("slot", "tensor"):
            cp = TorchCopier(ts, offs, refs, layout=layout, page_bytes=pages)
            for trial in range(3):
                fill = int(rng.integers(1, 127))
                ring = torch.full((7, sum(pages)), fill, dtype=torch.int8)
                ref = ring.clone()
                g = PageGather(ts, refs, cp.placement, ring)
                for group in (0, 1):
                    n = int(rng.integers(1, 5))
                    ids = rng.choice(NB, n, replace=False)
                    start = int(rng.integers(0, 7 - n + 1))
                    g(ring, start, group, ids)
                    cp.gather(ref, start, group, ids)
                assert torch.equal(ring, ref), (layout, trial)
                assert not torch.equal(ring, torch.full_like(ring, fill))
        print("GATHER_OK")
    """, PAGES)
    assert "GATHER_OK" in out


def test_kernel_inside_the_worker_under_random_operations():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import PageGather
        from ion_vllm.kv_tier.testing import run_random_ops
        from ion_vllm.kv_tier.worker import IonKVTierWorker

        class W(IonKVTierWorker):  # the CUDA choice, on CPU tensors (interpreter)
            def _ring_gather_fn(self, choice, is_cuda):
                self.ring_gather_impl = "kernel"
                return PageGather(self.tensors, self.copier.group_refs,
                                  self.copier.placement, self.ring.buffer)

        for layout, host_layout in (("ion", "slot"), ("kv_first", "tensor")):
            r = run_random_ops(5, 400, layout=layout, worker_cls=W, host_layout=host_layout)
            assert r.restored_blocks > 0 and r.verified_blocks > 0, r
            assert r.worker_stats["d2d_blocks"] > 0
        print("WORKER_OK")
    """)
    assert "WORKER_OK" in out


def test_refusals():
    from ion_vllm.kv_tier.page_gather import PageGather
    from ion_vllm.kv_tier.testing import run_random_ops
    from ion_vllm.kv_tier.worker import TorchCopier

    t = torch.zeros((4, 1000), dtype=torch.int8)  # 1000-byte pages: not 16-byte multiples
    cp = TorchCopier([t], [0], [[(0, 1000)]], page_bytes=[1000])
    with pytest.raises(ValueError, match="aligned"):
        PageGather([t], [[(0, 1000)]], cp.placement, torch.zeros((2, 1000), dtype=torch.int8))
    with pytest.raises(ValueError, match="ring_gather"):
        run_random_ops(1, 10, ring_gather="bogus")
    with pytest.raises(ValueError, match="CUDA"):
        run_random_ops(1, 10, ring_gather="kernel")  # CPU tensors
    r = run_random_ops(1, 50, ring_gather="auto")  # CPU: the copier's gather
    assert r.worker_stats["d2d_blocks"] > 0
    assert np.isfinite(r.worker_stats["ring_slots"])


def test_kernel_compiles_for_sm90_on_the_cpu():
    """The same kernel, compiled for Hopper without a GPU (Triton ships ptxas)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ion_vllm.kv_tier.page_gather import CHUNK_BYTES, _gather_pages_kernel

    src = ASTSource(fn=_gather_pages_kernel, constexprs={"CHUNK": CHUNK_BYTES},
                    signature={"ids_ptr": "*i64", "tab_ptr": "*i64", "ring_base": "i64",
                               "slot0": "i32", "CHUNK": "constexpr"})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    assert re.search(r"ld\.global\.\S*b64", ptx) and re.search(r"st\.global\.\S*b64", ptx)


def test_auto_falls_back_to_the_copier_on_a_layout_the_kernel_cannot_address(
        monkeypatch, caplog):
    """`auto` on CUDA with a KV layout PageGather refuses (alignment): the copier's gather,
    logged; `kernel` asked explicitly: the refusal is raised."""
    import logging

    from ion_vllm.kv_tier import page_gather
    from ion_vllm.kv_tier.testing import KVModel
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    kvm = KVModel("ion", 8, device="cpu", seed=0)
    w = IonKVTierWorker(kvm.canonical, num_host_blocks=4,
                        ring_bytes=2 * sum(c.page_size_bytes for c in kvm.canonical.tensors),
                        pin_memory=False, log_interval_s=0)

    class Refuses:
        def __init__(self, *a, **k):
            raise ValueError("PageGather: tensor 0 is not 16-byte aligned")

    monkeypatch.setattr(page_gather, "PageGather", Refuses)
    monkeypatch.setattr(page_gather, "available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        fn = w._ring_gather_fn("auto", True)
    assert fn == w.copier.gather and w.ring_gather_impl == "copier"
    assert "copy engines" in caplog.text
    with pytest.raises(ValueError, match="aligned"):
        w._ring_gather_fn("kernel", True)


# --------------------------------------------------------------------------
# HostPageCopy: loads (host -> GPU) on a few persistent programs, no copy engine
# --------------------------------------------------------------------------
def test_host_copy_matches_the_torch_copier_both_ways_and_layouts():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import HostPageCopy
        rng = np.random.default_rng(11)
        NH = 9
        for layout in ("slot", "tensor"):
            for programs in (1, 3, 8):  # fewer, as many as and more programs than items
                cp = TorchCopier(ts, offs, refs, layout=layout, page_bytes=pages)
                host = torch.randint(-128, 128, (NH, sum(pages)), dtype=torch.int8)
                hpc = HostPageCopy(ts, refs, cp.placement, host, torch.device("cpu"),
                                   programs=programs)
                hpc.warm_up()  # launches of no items: must copy nothing
                ref_host = host.clone()
                assert torch.equal(host, ref_host)
                for group in (0, 1):  # GPU -> host
                    n = int(rng.integers(1, 6))
                    g = rng.choice(NB, n, replace=False)
                    h = rng.choice(NH, n, replace=False)
                    hpc.to_host(host, group, g, h)
                    cp.to_host(ref_host, group, g, h)
                assert torch.equal(host, ref_host), (layout, programs)
                before = [t.clone() for t in ts]
                ref_ts = [t.clone() for t in ts]
                cp_ref = TorchCopier(ref_ts, offs, refs, layout=layout, page_bytes=pages)
                for group in (0, 1):  # host -> GPU
                    n = int(rng.integers(1, 6))
                    g = rng.choice(NB, n, replace=False)
                    h = rng.choice(NH, n, replace=False)
                    hpc.to_gpu(host, group, h, g)
                    cp_ref.to_gpu(host, group, h, g)
                assert all(torch.equal(a, b) for a, b in zip(ts, ref_ts)), (layout, programs)
                assert not all(torch.equal(a, b) for a, b in zip(ts, before))
        print("HOST_COPY_OK")
    """, PAGES)
    assert "HOST_COPY_OK" in out


def test_host_copy_loads_inside_the_worker_under_random_operations():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import HostPageCopy
        from ion_vllm.kv_tier.testing import run_random_ops
        from ion_vllm.kv_tier.worker import IonKVTierWorker

        class W(IonKVTierWorker):  # the CUDA choice, on CPU tensors (interpreter)
            def _load_copy_fn(self, choice, is_cuda):
                self.load_copy_impl = "kernel"
                return HostPageCopy(self.tensors, self.copier.group_refs,
                                    self.copier.placement, self.host, self.device,
                                    programs=3).to_gpu

        for layout, host_layout in (("ion", "slot"), ("kv_first", "tensor")):
            r = run_random_ops(6, 400, layout=layout, worker_cls=W, host_layout=host_layout)
            assert r.restored_blocks > 0 and r.verified_blocks > 0, r
            assert r.worker_stats["loaded_blocks"] > 0
        print("WORKER_LOAD_OK")
    """)
    assert "WORKER_LOAD_OK" in out


def test_host_copy_kernel_compiles_for_sm90_on_the_cpu():
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ion_vllm.kv_tier.page_gather import CHUNK_BYTES, _host_pages_kernel

    for to_gpu in (True, False):
        src = ASTSource(fn=_host_pages_kernel,
                        constexprs={"TO_GPU": to_gpu, "CHUNK": CHUNK_BYTES},
                        signature={"ids_ptr": "*i64", "n": "i32", "tab_ptr": "*i64",
                                   "ntab": "i32", "nchunk": "i32", "host_base": "i64",
                                   "TO_GPU": "constexpr", "CHUNK": "constexpr"})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx
        assert re.search(r"ld\.global\.\S*b64", ptx) and re.search(r"st\.global\.\S*b64", ptx)


def test_load_copy_choices_and_refusals(monkeypatch, caplog):
    """`bogus` refused; `kernel` refused on CPU tensors (and on an unpinned pool); `auto`
    on CPU: the copier; `auto` on CUDA with a layout HostPageCopy refuses: the copier,
    logged, while `kernel` asked explicitly raises."""
    import logging

    from ion_vllm.kv_tier import page_gather
    from ion_vllm.kv_tier.testing import KVModel, run_random_ops
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    with pytest.raises(ValueError, match="load_copy"):
        run_random_ops(1, 10, load_copy="bogus")
    with pytest.raises(ValueError, match="CUDA"):
        run_random_ops(1, 10, load_copy="kernel")
    r = run_random_ops(1, 60, load_copy="auto")
    assert r.worker_stats["store_jobs"] > 0

    kvm = KVModel("ion", 8, device="cpu", seed=0)
    w = IonKVTierWorker(kvm.canonical, num_host_blocks=4,
                        ring_bytes=2 * sum(c.page_size_bytes for c in kvm.canonical.tensors),
                        pin_memory=False, log_interval_s=0)
    assert w.load_copy_impl == "copier" and w.load_to_gpu == w.copier.to_gpu
    with pytest.raises(ValueError, match="pinned"):
        w._load_copy_fn("kernel", True)

    class Refuses:
        def __init__(self, *a, **k):
            raise ValueError("HostPageCopy: tensor 0 is not 16-byte aligned")

    monkeypatch.setattr(page_gather, "HostPageCopy", Refuses)
    monkeypatch.setattr(page_gather, "available", lambda: True)
    monkeypatch.setattr(w.host, "is_pinned", lambda: True, raising=False)
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        fn = w._load_copy_fn("auto", True)
    assert fn == w.copier.to_gpu and w.load_copy_impl == "copier"
    assert "copy engines" in caplog.text
    with pytest.raises(ValueError, match="aligned"):
        w._load_copy_fn("kernel", True)
