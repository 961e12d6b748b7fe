"""Randomized driver for the Ion KV tier: a manager + a worker on real tensors,
driven the way vLLM's OffloadingConnector drives them, checked against an
independent model.  Used by tests/test_kv_tier_*.py (CPU, simulated streams)
and by the GPU test (CUDA streams).

Every KV block gets random bf16 K and V data written through the *logical*
layout of the layer tensors (ION ``[nb, 2, Hkv, P, D]`` or K/V-first
``[2, nb, P, Hkv, D]``); every restored block is compared bit for bit.  GPU
blocks are overwritten with garbage as soon as vLLM would be allowed to reuse
them (after ``wait`` for flushed stores, right away for blocks not stored).
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key

from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.worker import IonKVTierWorker, canonicalize_layer_caches

CTX = ReqContext(req_id="harness")


class Corruption(AssertionError):
    pass


@dataclass
class HarnessResult:
    ops: dict[str, int] = field(default_factory=dict)
    restored_blocks: int = 0
    verified_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0
    no_space_blocks: int = 0
    worker_stats: dict = field(default_factory=dict)


class KVModel:
    """Per-layer tensors in one of the supported layouts + block (de)serializing."""

    def __init__(self, layout: str, num_blocks: int, num_layers: int = 2, hkv: int = 2,
                 page: int = 4, dim: int = 8, device: str = "cpu", seed: int = 0):
        self.layout, self.nb = layout, num_blocks
        self.shape_blk = (hkv, page, dim) if layout == "ion" else (page, hkv, dim)
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.gen = g
        self.layers = []
        for _ in range(num_layers):
            if layout == "ion":
                t = torch.zeros((num_blocks, 2, hkv, page, dim), dtype=torch.bfloat16)
            else:
                t = torch.zeros((2, num_blocks, page, hkv, dim), dtype=torch.bfloat16)
            self.layers.append(t.to(device))
        self.canonical = canonicalize_layer_caches(self.layers, num_blocks)

    def _kv(self, t: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (t[b, 0], t[b, 1]) if self.layout == "ion" else (t[0, b], t[1, b])

    def random_block(self) -> list[torch.Tensor]:
        out = []
        for _ in self.layers:
            kv = torch.randn((2, *self.shape_blk), generator=self.gen).to(torch.bfloat16)
            out.append(kv)
        return out

    def write(self, b: int, data: list[torch.Tensor]) -> None:
        for t, kv in zip(self.layers, data):
            k, v = self._kv(t, b)
            k.copy_(kv[0])
            v.copy_(kv[1])

    def scrub(self, b: int) -> None:
        for t in self.layers:
            k, v = self._kv(t, b)
            k.fill_(float("nan"))
            v.fill_(-7.0)

    def equal(self, b: int, data: list[torch.Tensor]) -> bool:
        for t, kv in zip(self.layers, data):
            k, v = self._kv(t, b)
            if not (torch.equal(k.cpu().view(torch.int16), kv[0].view(torch.int16))
                    and torch.equal(v.cpu().view(torch.int16), kv[1].view(torch.int16))):
                return False
        return True


def key_of(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


#: Every ring-shape option on at once (worker.py): the drain cut into 4 KiB copies, jobs
#: of more than 3 blocks copied GPU -> host directly, the gather at normal priority; the
#: harness's jobs are 1-6 blocks, so both the ring and the direct path are taken.
RING_SHAPE_OPTIONS = {"drain_chunk_bytes": 4096, "ring_max_job_blocks": 3,
                      "gather_priority": "normal"}


def took_ring_and_direct_paths(ws: dict) -> bool:
    """Whether a run's worker stats show blocks through the ring (gathered and drained)
    and blocks copied GPU -> host directly."""
    return ws["d2d_blocks"] > 0 and ws["drained_blocks"] > 0 and ws["spill_blocks"] > 0


def run_random_ops(
    seed: int,
    n_ops: int,
    layout: str = "ion",
    num_gpu_blocks: int = 48,
    num_host_blocks: int = 40,
    ring_slots: int = 6,
    window: int = 24,
    manager_cls=IonKVTierManager,
    worker_cls=IonKVTierWorker,
    copier: str = "torch",
    device: str = "cpu",
    runtime=None,
    overflow: str = "direct",
    completion: str = "read",
    host_layout: str = "slot",
    ring_gather: str = "auto",
    load_copy: str = "auto",
    issue_at: str = "submit",
    id_upload: str = "pin_memory",
    issue_api: str = "raw",
    worker_kw: dict | None = None,
) -> HarnessResult:
    rng = random.Random(seed)
    kvm = KVModel(layout, num_gpu_blocks, device=device, seed=seed)
    rt = runtime if runtime is not None else SimRuntime(eager=False)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    worker = worker_cls(kvm.canonical, num_host_blocks=num_host_blocks,
                        ring_bytes=ring_slots * slot + slot // 2 if ring_slots else 0,
                        runtime=rt, copier=copier, pin_memory=(device == "cuda"),
                        log_interval_s=0, overflow=overflow, completion=completion,
                        host_layout=host_layout, ring_gather=ring_gather,
                        load_copy=load_copy, issue_at=issue_at, id_upload=id_upload,
                        issue_api=issue_api, **(worker_kw or {}))
    budget = num_host_blocks * slot + rng.randrange(slot)
    mgr = manager_cls(num_host_blocks, slot, budget, window)
    res = HarnessResult()

    truth: dict[int, list[torch.Tensor]] = {}  # key id -> block data
    next_key = 0
    chains: list[list[int]] = []  # sequences of key ids (prefix chains)
    # model of the manager
    m_pending: set[int] = set()
    m_ref: dict[int, int] = {}  # ready keys -> ref count
    m_lru: OrderedDict[int, None] = OrderedDict()
    m_seq: dict[int, int] = {}  # key id -> order of its (latest) prepare_store
    seq_ctr = itertools.count()
    gpu_free = list(range(num_gpu_blocks))
    rng.shuffle(gpu_free)
    stores: dict[int, tuple[list[int], list[int], bool]] = {}  # job -> keys, gpu, flushed
    loads: dict[int, tuple[list[int], list[int]]] = {}
    job_ctr = 0

    def kid(k) -> int:
        return int.from_bytes(k[:8], "big")

    def free_gpu(blocks):
        for b in blocks:
            kvm.scrub(b)
            gpu_free.append(b)

    def check():
        mgr.check_invariants()
        worker.check_invariants()
        got = [kid(k) for k in mgr.lru_keys()]
        if got != list(m_lru):
            raise AssertionError(f"LRU order differs: {got[:8]} vs {list(m_lru)[:8]}")
        if mgr.used_bytes > budget:
            raise AssertionError("host byte budget exceeded")
        if worker.ring.alloc.used > worker.ring.num_slots:
            raise AssertionError("ring overflow")

    def poll():
        for r in worker.get_finished():
            assert r.success
            if r.job_id in stores:
                keys, gpu, flushed = stores.pop(r.job_id)
                mgr.complete_store([key_of(k) for k in keys], CTX)
                for k in sorted(keys, key=m_seq.__getitem__, reverse=True):
                    m_pending.discard(k)
                    m_ref[k] = 0
                    m_lru[k] = None
                if not flushed:
                    free_gpu(gpu)
            else:
                keys, gpu = loads.pop(r.job_id)
                for k, b in zip(keys, gpu):
                    if not kvm.equal(b, truth[k]):
                        raise Corruption(f"restored block of key {k} differs from the stored one")
                    res.restored_blocks += 1
                mgr.complete_load([key_of(k) for k in keys], CTX)
                for k in keys:
                    m_ref[k] -= 1
                for k in sorted(set(keys), key=m_seq.__getitem__, reverse=True):
                    if m_ref[k] == 0:
                        m_lru[k] = None
                free_gpu(gpu)

    def do_store():
        nonlocal next_key, job_ctr
        n = rng.randint(1, 6)
        if chains and rng.random() < 0.4:
            base = rng.choice(chains)
            keys = base[: rng.randint(1, len(base))]
            keys = keys + list(range(next_key, next_key + rng.randint(0, n)))
        else:
            keys = list(range(next_key, next_key + n))
        for k in keys:
            if k >= next_key:
                truth[k] = kvm.random_block()
        next_key = max([next_key] + [k + 1 for k in keys])
        chains.append(keys)
        if len(chains) > 64:
            chains.pop(0)
        if len(gpu_free) < len(keys):
            return
        gpu = [gpu_free.pop() for _ in keys]
        for k, b in zip(keys, gpu):
            kvm.write(b, truth[k])
        okeys = [key_of(k) for k in keys]
        # expected behaviour from the model
        new = [k for k in dict.fromkeys(keys) if k not in m_pending and k not in m_ref]
        room = max(0, window - len(m_pending))
        exp_drop = max(0, len(new) - room)
        new = new[:room]
        free_host = num_host_blocks - len(m_pending) - len(m_ref)
        need = len(new) - free_host
        exp_evict = []
        if need > 0:
            exp_evict = [k for k in m_lru if k not in set(keys)][:need]
        out = mgr.prepare_store(okeys, CTX)
        got_evict = [kid(k) for k in out.evicted_keys]
        if got_evict != exp_evict:
            raise AssertionError(f"evicted {got_evict}, LRU model says {exp_evict}")
        for k in exp_evict:
            del m_lru[k]
            del m_ref[k]
        stored = [kid(k) for k in out.keys_to_store]
        for k in stored:
            m_seq[k] = next(seq_ctr)
        exp_store = new[: len(new) - max(0, need - len(exp_evict))]
        if stored != exp_store:
            raise AssertionError(f"stored {stored}, expected {exp_store}")
        res.evicted_blocks += len(exp_evict)
        res.dropped_blocks += exp_drop
        res.no_space_blocks += max(0, need - len(exp_evict))
        res.stored_blocks += len(stored)
        m_pending.update(stored)
        stored_set = set(stored)
        kept = [(k, b) for k, b in zip(keys, gpu) if k in stored_set]
        rest = [(k, b) for k, b in zip(keys, gpu) if k not in stored_set]
        free_gpu([b for _, b in rest])
        if kept:
            job_ctr += 1
            src = GPULoadStoreSpec([b for _, b in kept], group_sizes=[len(kept)],
                                   block_indices=[0])
            worker.submit_store(job_ctr, src, out.store_spec)
            stores[job_ctr] = ([k for k, _ in kept], [b for _, b in kept], False)

    def do_flush():
        cand = [j for j, (_, _, f) in stores.items() if not f]
        if not cand:
            return
        jobs = set(rng.sample(cand, rng.randint(1, min(3, len(cand)))))
        worker.wait(jobs)
        for j in jobs:
            keys, gpu, _ = stores[j]
            stores[j] = (keys, gpu, True)
            free_gpu(gpu)  # vLLM may reuse the source blocks right after wait()

    def do_lookup_load():
        nonlocal job_ctr
        if not chains:
            return
        chain = rng.choice(chains)
        hits = []
        for k in chain:
            r = mgr.lookup(key_of(k), CTX)
            exp = (LookupResult.HIT if k in m_ref else
                   LookupResult.HIT_PENDING if k in m_pending else LookupResult.MISS)
            if r != exp:
                raise AssertionError(f"lookup({k}) = {r}, expected {exp}")
            if r != LookupResult.HIT:
                break
            hits.append(k)
        mgr.touch([key_of(k) for k in chain], CTX)
        for k in reversed(chain):
            if k in m_lru:
                m_lru.move_to_end(k)
        hits = list(dict.fromkeys(hits))[: rng.randint(1, 4)]
        if not hits or len(gpu_free) < len(hits):
            return
        spec = mgr.prepare_load([key_of(k) for k in hits], CTX)
        for k in hits:
            if m_ref[k] == 0:
                del m_lru[k]
            m_ref[k] += 1
        gpu = [gpu_free.pop() for _ in hits]
        for b in gpu:
            kvm.scrub(b)
        job_ctr += 1
        worker.submit_load(job_ctr, spec,
                           GPULoadStoreSpec(gpu, group_sizes=[len(gpu)], block_indices=[0]))
        loads[job_ctr] = (hits, gpu)

    def do_touch():
        if not truth:
            return
        ks = [rng.randrange(next_key) for _ in range(rng.randint(1, 5))]
        mgr.touch([key_of(k) for k in ks], CTX)
        for k in reversed(ks):
            if k in m_lru:
                m_lru.move_to_end(k)

    ops = [("store", do_store, 5), ("flush", do_flush, 2), ("load", do_lookup_load, 4),
           ("touch", do_touch, 1),
           ("tick", lambda: rt.step(rng, rng.randint(1, 12)) if hasattr(rt, "step") else None, 5),
           ("poll", poll, 4)]
    names = [o[0] for o in ops]
    fns = {o[0]: o[1] for o in ops}
    weights = [o[2] for o in ops]
    for _ in range(n_ops):
        name = rng.choices(names, weights)[0]
        fns[name]()
        res.ops[name] = res.ops.get(name, 0) + 1
        check()

    # quiesce, then restore every block the manager holds and compare
    for _ in range(10000):
        if hasattr(rt, "run_all"):
            rt.run_all()
        elif device == "cuda":
            torch.cuda.synchronize()
        poll()
        if not stores and not loads:
            break
    assert not stores and not loads, "transfers never completed"
    check()
    ready = list(m_ref)
    for i in range(0, len(ready), 8):
        ks = ready[i:i + 8]
        if len(gpu_free) < len(ks):
            break
        spec = mgr.prepare_load([key_of(k) for k in ks], CTX)
        for k in ks:
            if m_ref[k] == 0:
                del m_lru[k]
            m_ref[k] += 1
        gpu = [gpu_free.pop() for _ in ks]
        for b in gpu:
            kvm.scrub(b)
        job_ctr += 1
        worker.submit_load(job_ctr, spec, GPULoadStoreSpec(gpu, group_sizes=[len(gpu)],
                                                           block_indices=[0]))
        loads[job_ctr] = (ks, gpu)
        worker.wait({job_ctr})
        poll()
        res.verified_blocks += len(ks)
    check()

    # counters agree with the model and with each other
    c, ws = mgr.counters, worker.stats
    assert c.stored_blocks == res.stored_blocks, "stored counter drift"
    assert c.completed_store_blocks == res.stored_blocks, "completed counter drift"
    assert c.evicted_blocks == res.evicted_blocks, "evicted counter drift"
    assert c.store_dropped_blocks == res.dropped_blocks, "dropped counter drift"
    assert c.store_no_space_blocks == res.no_space_blocks, "no-space counter drift"
    assert ws.drained_blocks + ws.bypass_blocks + ws.spill_blocks == res.stored_blocks, \
        "worker store count drift"
    assert ws.d2d_blocks == ws.drained_blocks, "ring d2d/drain count drift"
    assert ws.loaded_blocks == c.loaded_blocks == res.restored_blocks, "load count drift"
    assert ws.ring_peak_slots <= worker.ring.num_slots
    assert len(m_ref) == mgr.used_blocks
    res.worker_stats = ws.as_dict()
    return res
