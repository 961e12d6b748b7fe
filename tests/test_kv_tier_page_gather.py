"""The GPU -> ring gather kernel (ion_vllm/kv_tier/page_gather.py) on the CPU, through
Triton's interpreter: its addressing against the torch copier's gather, and inside the
worker under the randomized store/evict/load/preempt harness; its compile for sm_90; and
the worker's fallback to the copier's gather.  The interpreter is chosen when the kernel
is defined, so those run in a subprocess."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: KV pages the kernel is checked on: 3 tensors of NB blocks with pages of different
#: sizes (one > CHUNK_BYTES: several chunks per page, and not a multiple of it), GPU row
#: stride > page (padded rows), 2 KV groups (the second copying a prefix of tensor 2's page)
PAGES = """
    import numpy as np, torch
    from ion_vllm.kv_tier.page_gather import CHUNK_BYTES
    from ion_vllm.kv_tier.copies import TorchCopier
    NB = 12
    pages = [4096, CHUNK_BYTES + 2048, 1024]
    ts = [torch.randint(-128, 128, (NB, p + 64 * k), dtype=torch.int8)
          for k, p in enumerate(pages)]
    offs = [int(x) for x in np.cumsum([0] + pages[:-1])]
    refs = [[(0, pages[0]), (1, pages[1])], [(2, 512)]]
"""


def _interpret(code: str, prelude: str = "") -> str:
    src = textwrap.dedent(prelude) + textwrap.dedent(code)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    r = subprocess.run([sys.executable, "-c", src], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_kernel_matches_the_torch_gather():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import PageGather
        rng = np.random.default_rng(7)
        cp = TorchCopier(ts, offs, refs)
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
            assert torch.equal(ring, ref), trial
            assert not torch.equal(ring, torch.full_like(ring, fill))
        print("GATHER_OK")
    """, PAGES)
    assert "GATHER_OK" in out


def test_kernel_inside_the_worker_under_random_operations():
    out = _interpret("""
        from ion_vllm.kv_tier.page_gather import PageGather
        from kv_tier_harness import run_random_ops
        from ion_vllm.kv_tier.worker import IonKVTierWorker

        class W(IonKVTierWorker):  # the CUDA choice, on CPU tensors (interpreter)
            def _make_ring_gather(self, is_cuda):
                g = PageGather(self.tensors, self.copier.group_refs,
                               self.copier.placement, self.ring.buffer)
                g.warm_up()
                return g, "kernel"

        for layout in ("ion", "kv_first"):
            r = run_random_ops(5, 400, layout=layout, worker_cls=W)
            assert r.restored_blocks > 0 and r.verified_blocks > 0, r
            assert r.worker_stats["d2d_blocks"] > 0
        print("WORKER_OK")
    """)
    assert "WORKER_OK" in out


def test_refusals():
    from ion_vllm.kv_tier.copies import TorchCopier
    from ion_vllm.kv_tier.page_gather import PageGather

    t = torch.zeros((4, 1000), dtype=torch.int8)  # 1000-byte pages: not 16-byte multiples
    cp = TorchCopier([t], [0], [[(0, 1000)]])
    with pytest.raises(ValueError, match="aligned"):
        PageGather([t], [[(0, 1000)]], cp.placement, torch.zeros((2, 1000), dtype=torch.int8))


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


def test_the_worker_falls_back_to_the_copier_on_a_layout_the_kernel_cannot_address(
        monkeypatch, caplog):
    """On CUDA with a KV layout PageGather refuses (alignment): the copier's gather,
    logged; on a CPU, or for a ring of no slots, the copier's gather too."""
    import logging

    from kv_tier_harness import KVModel, make_worker

    from ion_vllm.kv_tier import page_gather

    kvm = KVModel("ion", 8, device="cpu", seed=0)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    w = make_worker(kvm.canonical, 4, 2 * slot)
    assert w.ring_gather_impl == "copier" and w.ring_gather == w.copier.gather

    class Refuses:
        def __init__(self, *a, **k):
            raise ValueError("PageGather: tensor 0 is not 16-byte aligned")

    monkeypatch.setattr(page_gather, "PageGather", Refuses)
    monkeypatch.setattr(page_gather, "available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        fn, impl = w._make_ring_gather(True)
    assert fn == w.copier.gather and impl == "copier"
    assert "copy engines" in caplog.text and "aligned" in caplog.text
    w0 = make_worker(kvm.canonical, 4, 0)
    assert w0._make_ring_gather(True) == (w0.copier.gather, "copier")  # no slots
