"""GPU tests of the Ion KV tier worker (CUDA streams, both copy paths)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("ring_gather", ["kernel", "copier"])
@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("copier", ["batch", "torch"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_cuda(copier, layout, host_layout, ring_gather):
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops

    r = run_random_ops(21, 3000, layout=layout, copier=copier, device="cuda",
                       runtime=CudaRuntime(torch.device("cuda")), host_layout=host_layout,
                       ring_gather=ring_gather, issue_api="torch")
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0  # the ring path (and its gather) ran
    assert r.worker_stats["ring_peak_slots"] <= r.worker_stats["ring_slots"]


@pytest.mark.gpu
@pytest.mark.parametrize("issue_at", ["submit", "finish"])
@pytest.mark.parametrize("load_copy", ["kernel", "copier"])
@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_cuda_load_paths(layout, host_layout, load_copy, issue_at):
    """Both host -> GPU load paths under the randomized harness (every restored block
    verified), with transfers issued at submit or at the next get_finished; the kernel
    is what "auto" picks on CUDA with a pinned pool."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops

    r = run_random_ops(23, 3000, layout=layout, copier="batch", device="cuda",
                       runtime=CudaRuntime(torch.device("cuda")), host_layout=host_layout,
                       load_copy=load_copy, issue_at=issue_at, issue_api="torch")
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["loaded_blocks"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("issue_at", ["submit", "finish"])
def test_random_ops_cuda_staged_id_uploads(issue_at):
    """id_upload="staged" with staging buffers of 24 ids, so that regions wrap around and
    are reused while copies on other streams may still read them: every restored block
    verified under the randomized harness."""
    from ion_vllm.kv_tier.page_gather import IdUpload
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    uploads = []

    class SmallStaging(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            for kernel in (self.ring_gather, self.load_to_gpu.__self__):
                kernel.upload = IdUpload(self.device, capacity=24)
                uploads.append(kernel.upload)

    r = run_random_ops(29, 3000, device="cuda", copier="batch", worker_cls=SmallStaging,
                       runtime=CudaRuntime(torch.device("cuda")), issue_at=issue_at,
                       id_upload="staged", issue_api="torch")
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0 and r.worker_stats["loaded_blocks"] > 0
    assert all(u.staged > 0 for u in uploads), [(u.staged, u.fallbacks) for u in uploads]
    print("staged / fallbacks:", [(u.staged, u.fallbacks) for u in uploads])


def _store_zero_until_reported(w, caches, gpu, after_submit=None):
    """Store GPU blocks ``gpu`` into host blocks 0.. as job 1, wait until the sources may be
    reused, zero them, and poll ``get_finished`` until it reports something; returns that
    report.  ``after_submit``: a check asserted right after ``submit_store``."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec

    w.submit_store(1, GPULoadStoreSpec(gpu, [len(gpu)], [0]),
                   IonHostSpec(list(range(len(gpu)))))
    if after_submit is not None:
        assert after_submit()
    w.wait({1})
    for c in caches:
        c[gpu] = 0
    done = []
    while not done:
        done = w.get_finished()
    return done


@pytest.mark.gpu
def test_store_load_roundtrip_bandwidth():
    """64 blocks of 2 MiB (8 layers) through a 32 MiB ring and back; bytes identical."""
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec
    from ion_vllm.kv_tier.worker import IonKVTierWorker, canonicalize_layer_caches

    nb, layers = 256, 8
    caches = [torch.randn(nb, 2, 8, 64, 128, device="cuda").to(torch.bfloat16)
              for _ in range(layers)]
    w = IonKVTierWorker(canonicalize_layer_caches(caches, nb), num_host_blocks=128,
                        ring_bytes=32 << 20, log_interval_s=0, issue_api="torch",
                        load_copy="auto")
    assert w.load_copy_impl == "kernel"  # "auto" on CUDA with a pinned pool
    gpu = np.random.default_rng(0).permutation(nb)[:64].tolist()
    ref = [c[gpu].clone() for c in caches]
    done = _store_zero_until_reported(w, caches, gpu)
    assert done[0].job_id == 1
    w.submit_load(2, IonHostSpec(list(range(64))), GPULoadStoreSpec(gpu, [64], [0]))
    w.wait({2})
    assert w.get_finished()[0].job_id == 2
    for c, r in zip(caches, ref):
        assert torch.equal(c[gpu], r)
    print(w.stats.as_dict())
    assert w.stats.d2h_gbps > 1 and w.stats.h2d_gbps > 1


@pytest.mark.gpu
def test_finish_store_waits_for_the_compute_work_before_submit_not_after():
    """issue_at="finish", with the gather on its own stream (on the compute stream it
    would wait for the later work by construction): a store issued after more compute work
    was enqueued (the next step's forward pass) still reads its blocks as soon as the work
    before its submit is done: its ring gather completes while a later 200 ms sleep on the
    compute stream still runs, and the bytes are the ones written before the submit."""
    import time

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec
    from ion_vllm.kv_tier.worker import IonKVTierWorker, canonicalize_layer_caches

    nb = 32
    caches = [torch.zeros(nb, 2, 4, 16, 128, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    w = IonKVTierWorker(canonicalize_layer_caches(caches, nb), num_host_blocks=16,
                        ring_bytes=8 << 20, log_interval_s=0, issue_at="finish",
                        issue_api="torch", gather_stream="own")
    gpu = [3, 9, 17]
    torch.cuda._sleep(20_000_000)  # ~10 ms of compute before the blocks are written
    want = [torch.randn(len(gpu), 2, 4, 16, 128, device="cuda").to(torch.bfloat16)
            for _ in caches]
    for c, x in zip(caches, want):
        c[gpu] = x
    w.submit_store(1, GPULoadStoreSpec(gpu, [3], [0]), IonHostSpec([0, 1, 2]))
    job = w._stores[1]
    assert job.after is not None and not job.pieces  # recorded, not issued
    torch.cuda._sleep(400_000_000)  # the next step's forward pass: ~200 ms
    busy = torch.cuda.Event()
    busy.record()
    # issues the store; it may report it at once (the gather waits only for the mark, which
    # the first sleep may have passed by now): the H100 run of 2026-12-06 lost it here
    done = {r.job_id for r in w.get_finished()}
    assert job.pieces
    t0 = time.monotonic()
    while not all(p.read_done.query() for p in job.pieces):
        assert time.monotonic() - t0 < 5
    assert not busy.query(), "the gather waited for compute work enqueued after submit"
    torch.cuda.synchronize()
    for _ in range(100):
        done |= {r.job_id for r in w.get_finished()}
        if 1 in done:
            break
    assert 1 in done
    for c in caches:
        c[gpu] = 0
    w.submit_load(2, IonHostSpec([0, 1, 2]), GPULoadStoreSpec(gpu, [3], [0]))
    w.wait({2})
    for c, x in zip(caches, want):
        assert torch.equal(c[gpu], x)
    assert w.stats.d2d_blocks == 3  # through the ring, not spilled


@pytest.mark.gpu
@pytest.mark.parametrize("issue_at", ["submit", "finish"])
@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_cuda_raw_issue(layout, host_layout, issue_at):
    """issue_api="raw": the ring gather and the loads through their compiled Triton
    launchers with staged ids, the drains as cudaMemcpyAsync on explicit streams, the
    stream switches of the other copies without a context: every restored block verified
    under the randomized harness."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops

    r = run_random_ops(37, 3000, layout=layout, copier="batch", device="cuda",
                       runtime=CudaRuntime(torch.device("cuda"), lean=True),
                       host_layout=host_layout, issue_at=issue_at, issue_api="raw")
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    ws = r.worker_stats
    assert ws["d2d_blocks"] > 0 and ws["drained_blocks"] > 0 and ws["loaded_blocks"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_cuda_ring_shape_options(layout, host_layout):
    """The ring drain cut into 4 KiB copies issued in one cuMemcpyBatchAsync, jobs of more
    than 3 blocks copied GPU -> host directly, the gather at normal priority: every
    restored block verified under the randomized harness, both paths taken."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import (
        RING_SHAPE_OPTIONS,
        run_random_ops,
        took_ring_and_direct_paths,
    )

    r = run_random_ops(43, 3000, layout=layout, copier="batch", device="cuda",
                       runtime=CudaRuntime(torch.device("cuda"), lean=True),
                       host_layout=host_layout, issue_api="raw",
                       worker_kw=RING_SHAPE_OPTIONS)
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert took_ring_and_direct_paths(r.worker_stats)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{"gather_ids": "host"}, {"gather_stream": "drain"},
                                  {"gather_ids": "host", "gather_stream": "drain"},
                                  {"gather_stream": "own"}],
                         ids=["host-ids", "drain-stream", "both", "own-stream"])
def test_random_ops_cuda_gather_path_options(opts):
    """The ring gather reading its block ids from pinned host memory through unified
    addressing (no host -> device copy), and/or queued on the drain stream, or on a
    stream of its own (the default until the thirty-first session): every restored block
    verified under the randomized harness, blocks through the ring, and (host ids) the
    mapped id stage used with no device buffer."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    made = []

    class Keep(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    r = run_random_ops(47, 3000, copier="batch", device="cuda", worker_cls=Keep,
                       runtime=CudaRuntime(torch.device("cuda"), lean=True),
                       issue_api="raw", worker_kw=opts)
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0
    w = made[-1]
    assert w._raw_gather is not None  # the compiled launch, not the dispatcher
    if opts.get("gather_ids") == "host":
        assert w._gather_id_stage.mapped and w._gather_id_stage.buf is None
        assert w._gather_id_stage.staged > 0
    if opts.get("gather_stream") == "drain":
        assert w._d2d is w._drain
    if opts.get("gather_stream") == "own":
        assert w._d2d is not None and w._d2d is not w._drain


@pytest.mark.gpu
@pytest.mark.parametrize("issue_at", ["submit", "finish"])
def test_random_ops_cuda_gather_on_the_compute_stream(issue_at):
    """The ``ion-onestream`` data path (the defaults) on CUDA: the ring gather on the
    current (compute) stream and loads through the copy engines, under the randomized
    harness (the harness writes its KV blocks on the same current stream): every restored
    block verified, blocks through the ring, no gather stream made, and the gather's end
    events recorded on the current stream."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    made, where = [], []

    class Keep(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    class Log(CudaRuntime):
        def record(self, stream):
            where.append(stream.cuda_stream)
            return super().record(stream)

    r = run_random_ops(53, 3000, copier="batch", device="cuda", worker_cls=Keep,
                       runtime=Log(torch.device("cuda"), lean=True), issue_api="raw",
                       issue_at=issue_at, load_copy="copier",
                       worker_kw={"gather_stream": "compute"})
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0
    w = made[-1]
    assert w._d2d is None and w.load_copy_impl == "copier" and w._raw_gather is not None
    assert torch.cuda.current_stream().cuda_stream in where


@pytest.mark.gpu
def test_random_ops_cuda_raw_issue_small_id_stage():
    """issue_api="raw" with an id stage of 24 ids, so that regions wrap around while
    launches on other streams may still read them, and whose completion check answers
    "still in use" for every other region (conservative, as a slow GPU would), so that
    puts also fall back to fresh tensors: every restored block verified.  (On the H100 a
    stage of 24 ids alone never fell back: 1,120 puts, 0 fallbacks.)"""
    from ion_vllm.kv_tier.raw_issue import IdStage
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    stages = []

    class SmallStage(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            flip = iter(range(10**9))
            stage = IdStage(self.device, self._ptr_copy, capacity=24,
                            done=lambda ev: next(flip) % 2 == 0 and ev.query())
            self._raw_gather.raw_ids = self._raw_load.raw_ids = stage
            stages.append(stage)

    r = run_random_ops(41, 3000, device="cuda", copier="batch", worker_cls=SmallStage,
                       runtime=CudaRuntime(torch.device("cuda"), lean=True),
                       issue_api="raw")
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    (s,) = stages
    assert s.staged > 0 and s.fallbacks > 0, (s.staged, s.fallbacks)


@pytest.mark.gpu
@pytest.mark.parametrize("load_copy", ["auto", "copier"])
def test_raw_issue_roundtrip_through_the_engine_default_runtime(load_copy):
    """issue_api="raw" with the runtime the worker builds itself (lean stream switches):
    64 blocks through a 32 MiB ring and back, bytes identical, and the caller's current
    stream is the same afterwards; loads through the Triton load kernel's raw launcher
    ("auto") and through the copy engines (the default, "copier")."""
    import numpy as np
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec
    from ion_vllm.kv_tier.worker import IonKVTierWorker, canonicalize_layer_caches

    nb, layers = 256, 8
    caches = [torch.randn(nb, 2, 8, 64, 128, device="cuda").to(torch.bfloat16)
              for _ in range(layers)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        w = IonKVTierWorker(canonicalize_layer_caches(caches, nb), num_host_blocks=128,
                            ring_bytes=32 << 20, log_interval_s=0, issue_api="raw",
                            load_copy=load_copy)
        assert w.rt.lean and w._raw_gather is not None
        assert (w._raw_load is not None) == (load_copy == "auto"), w.load_copy_impl
        gpu = np.random.default_rng(1).permutation(nb)[:64].tolist()
        ref = [c[gpu].clone() for c in caches]
        _store_zero_until_reported(
            w, caches, gpu, after_submit=lambda: torch.cuda.current_stream() == side)
        w.submit_load(2, IonHostSpec(list(range(64))), GPULoadStoreSpec(gpu, [64], [0]))
        w.wait({2})
        assert torch.cuda.current_stream() == side
    torch.cuda.synchronize()
    for c, r in zip(caches, ref):
        assert torch.equal(c[gpu], r)
    assert w.stats.d2d_blocks > 0 and w.stats.spill_blocks > 0  # ring and direct paths


@pytest.mark.gpu
def test_random_ops_cuda_store_batching():
    """Store batching on CUDA streams: held one-block jobs issued together as one ring
    piece (one gather over several requests' blocks, one drain), with flushes and
    preemptions of held jobs; every restored block verified, and batches formed."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops

    r = run_random_ops(48, 3000, copier="batch", device="cuda",
                       runtime=CudaRuntime(torch.device("cuda"), lean=True), issue_api="raw",
                       worker_kw={"store_batch_blocks": 4, "store_batch_steps": 3})
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["store_batches"] > 0 and r.worker_stats["d2d_blocks"] > 0


@pytest.mark.gpu
def test_random_ops_cuda_idle_ring():
    """The idle-ring probe on CUDA streams (``ring_idle``, bench config ``ion-ringidle``):
    the ring allocated and its gather compiled, every block copied GPU -> host directly;
    every restored block verified, and not one block through the ring."""
    from ion_vllm.kv_tier.runtime import CudaRuntime
    from ion_vllm.kv_tier.testing import run_random_ops

    r = run_random_ops(49, 3000, copier="batch", device="cuda",
                       runtime=CudaRuntime(torch.device("cuda"), lean=True), issue_api="raw",
                       worker_kw={"ring_idle": True})
    assert r.restored_blocks > 0 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] == 0 and r.worker_stats["spill_blocks"] > 0
