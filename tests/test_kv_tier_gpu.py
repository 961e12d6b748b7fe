"""GPU tests of the Ion KV tier worker on CUDA streams (marked ``gpu``; run on an H100 or
H200 with ``python3 -m pytest -m gpu tests/test_kv_tier_gpu.py``): the randomized
store/evict/load/flush harness with every restored block verified, block verification on
the GPU, a store/load round trip, and the ring's HBM bound."""

import numpy as np
import pytest
import torch

from kv_tier_harness import KVModel, fresh_seed, make_worker, run_random_ops  # noqa: F401

from ion_vllm.kv_tier.runtime import CudaRuntime
from ion_vllm.kv_tier.worker import IonKVTierWorker

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _keep(made):
    """A worker class that appends each worker it makes to ``made``."""

    class Keep(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    return Keep


class _RecordLog(CudaRuntime):
    """A CudaRuntime that logs the CUDA stream of every event it records."""

    def __init__(self, device):
        super().__init__(device)
        self.recorded = []

    def record(self, stream):
        self.recorded.append(stream.cuda_stream)
        return super().record(stream)


@pytest.mark.parametrize("copier", ["batch", "torch"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_cuda(layout, copier, fresh_seed, monkeypatch):
    """The default data path on CUDA (the ring gather kernel on the current, compute
    stream; spills, drains and loads on the copy engines through vLLM's batched copy, or
    plain torch copies where that is missing): 3,000 random operations, every restored
    block verified, the ring used and never over its slots, and the gather's events on the
    current stream."""
    from ion_vllm.kv_tier import worker as W

    if copier == "torch":
        monkeypatch.setattr(W, "batch_copier_available", lambda: False)
    made = []
    rt = _RecordLog(torch.device("cuda"))
    r = run_random_ops(fresh_seed, 3000, layout=layout, device="cuda", runtime=rt,
                       worker_cls=_keep(made))
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    ws = r.worker_stats
    assert ws["d2d_blocks"] > 0 and ws["loaded_blocks"] > 0
    assert ws["ring_peak_slots"] <= ws["ring_slots"]
    w = made[-1]
    assert w.ring_gather_impl == "kernel" and w.copier.name == copier
    assert torch.cuda.current_stream().cuda_stream in rt.recorded  # the gather's events


def test_random_ops_cuda_copier_gather(fresh_seed, monkeypatch):
    """The gather's fallback (the copier's copy-engine gather, taken for a KV layout the
    kernel cannot address) under the same harness."""
    from ion_vllm.kv_tier import page_gather

    monkeypatch.setattr(page_gather, "available", lambda: False)
    made = []
    r = run_random_ops(fresh_seed, 3000, device="cuda", worker_cls=_keep(made),
                       runtime=CudaRuntime(torch.device("cuda")))
    assert r.restored_blocks > 0 and r.worker_stats["d2d_blocks"] > 0
    assert made[-1].ring_gather_impl == "copier"


def test_verify_on_cuda_streams(fresh_seed):
    """Verify mode on CUDA streams: the harness restores every block with 0 mismatches,
    and one flipped byte in pinned host memory is reported."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec

    res = run_random_ops(fresh_seed, 2000, device="cuda", verify=True,
                         runtime=CudaRuntime(torch.device("cuda")))
    ws = res.worker_stats
    assert ws["verified_blocks"] == res.restored_blocks > 0
    assert ws["verify_mismatch_blocks"] == 0

    kvm = KVModel("ion", 16, device="cuda")
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    w = make_worker(kvm.canonical, 8, 2 * slot, verify=True)
    for b in range(6):
        kvm.write(b, kvm.random_block())
    w.submit_store(1, GPULoadStoreSpec(list(range(6)), [6], [0]), IonHostSpec(list(range(6))))
    w.wait({1})  # 2 blocks through the ring, 4 spilled
    done = set()
    while 1 not in done:
        done |= {x.job_id for x in w.get_finished()}
    assert w.stats.spill_blocks == 4 and w.stats.d2d_blocks == 2
    w.host[4, 17] ^= 0x08
    w.submit_load(2, IonHostSpec(list(range(6))), GPULoadStoreSpec(list(range(8, 14)), [6], [0]))
    w.wait({2})
    while 2 not in done:
        done |= {x.job_id for x in w.get_finished()}
    assert w.stats.verified_blocks == 6 and w.stats.verify_mismatch_blocks == 1


def _caches(nb=256, layers=8):
    """``layers`` ION-layout layers of ``nb`` blocks of 64 tokens x 8 heads x 128 (bf16):
    2 MiB a block over all layers."""
    from kv_tier_harness import canonicalize_layer_caches

    caches = [torch.randn(nb, 2, 8, 64, 128, device="cuda").to(torch.bfloat16)
              for _ in range(layers)]
    return caches, canonicalize_layer_caches(caches, nb)


def _store_load(w, caches, gpu, job=1):
    """Store GPU blocks ``gpu`` into host blocks 0.., zero them once vLLM could reuse them,
    load them back into the same blocks; returns the reports of both jobs."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec

    n = len(gpu)
    w.submit_store(job, GPULoadStoreSpec(gpu, [n], [0]), IonHostSpec(list(range(n))))
    w.wait({job})
    for c in caches:
        c[gpu] = 0
    done = []
    while not done:
        done = w.get_finished()
    w.submit_load(job + 1, IonHostSpec(list(range(n))), GPULoadStoreSpec(gpu, [n], [0]))
    w.wait({job + 1})
    return done + w.get_finished()


def test_store_load_roundtrip():
    """64 blocks of 2 MiB through a 32 MiB ring (16 slots; the rest spilled) and back,
    issued from a side stream the caller made current: bytes identical, the caller's
    stream current again afterwards, and both D2H and H2D rates measured."""
    caches, kv = _caches()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        w = make_worker(kv, 128, 32 << 20)
        assert w.ring_gather_impl == "kernel" and w.ring.num_slots == 16
        gpu = np.random.default_rng(1).permutation(256)[:64].tolist()
        ref = [c[gpu].clone() for c in caches]
        reports = _store_load(w, caches, gpu)
        assert torch.cuda.current_stream() == side
    torch.cuda.synchronize()
    assert sorted(r.job_id for r in reports) == [1, 2]
    for c, r in zip(caches, ref):
        assert torch.equal(c[gpu], r)
    print(w.stats.as_dict())
    assert w.stats.d2d_blocks == 16 and w.stats.spill_blocks == 48
    assert w.stats.d2h_gbps > 1 and w.stats.h2d_gbps > 1


def test_ring_hbm_never_above_its_size():
    """The tier's HBM is its ring: the worker allocates at most the ring (plus its gather's
    page tables and per-launch block ids, a few KiB), and storing and restoring 4x the
    ring's bytes, over and over, never takes more device memory than that."""
    caches, kv = _caches()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ring = 16 << 20
    w = make_worker(kv, 128, ring)
    slack = 1 << 20
    held = torch.cuda.memory_allocated() - base
    assert w.ring.nbytes <= ring and held <= ring + slack, held
    torch.cuda.reset_peak_memory_stats()
    gpu = np.random.default_rng(2).permutation(256)[:32].tolist()  # 64 MiB: 4 rings
    for k in range(4):
        _store_load(w, caches, gpu, job=10 * k + 1)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= ring + slack, (peak, ring)
    assert w.stats.ring_peak_slots <= w.ring.num_slots == 8
    assert w.stats.d2d_blocks > 0 and w.stats.spill_blocks > 0
