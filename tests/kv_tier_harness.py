"""Randomized driver for the Ion KV tier, for the tests (CPU, simulated streams) and the
GPU tests (CUDA streams): a manager + a worker on real tensors, driven the way vLLM's
OffloadingConnector drives them, checked against an independent model.

Every KV block gets random bf16 K and V data written through the *logical* layout of the
layer tensors (ION ``[nb, 2, Hkv, P, D]`` or K/V-first ``[2, nb, P, Hkv, D]``); every
restored block is compared bit for bit.  GPU blocks are overwritten with garbage as soon as
vLLM would be allowed to reuse them (after ``wait`` for flushed stores, right away for
blocks not stored).

``fresh_seed`` (a fixture: import it into a test module) gives each property test a new
seed per run, printed and recorded (``record_property``) and named in the failure
(``run_random_ops`` adds it as a note); ``KV_TIER_SEED=<seed>`` replays one.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)

from ion_vllm.kv_tier.config import KVTierConfig
from ion_vllm.kv_tier.manager import IonHostSpec, IonKVTierManager
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.worker import IonKVTierWorker

CTX = ReqContext(req_id="harness")


def _rows(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a blocks-first tensor as (num_blocks, bytes) int8 without copying."""
    assert t.shape[0] == num_blocks
    inner = t[0] if num_blocks else t
    if not inner.is_contiguous():
        raise ValueError("the bytes of one KV block must be contiguous")
    nbytes = inner.numel() * t.element_size()
    raw = torch.empty(0, dtype=torch.int8, device=t.device).set_(t.untyped_storage())
    return torch.as_strided(
        raw, (num_blocks, nbytes), (t.stride(0) * t.element_size(), 1),
        t.storage_offset() * t.element_size(),
    )


def canonicalize_layer_caches(
    caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    num_blocks: int,
    layout: str = "auto",
) -> CanonicalKVCaches:
    """Build CanonicalKVCaches (single KV group) from per-layer KV tensors, as vLLM's
    OffloadingConnector hands them to the spec.

    layout: "blocks_first" ([num_blocks, ...], e.g. ION [num_blocks, 2, Hkv, P, D]),
    "kv_first" ([2, num_blocks, ...], e.g. [2, num_blocks, P, Hkv, D]) or "auto"
    (dim 0 == num_blocks -> blocks_first, else dim 0 == 2 and dim 1 ==
    num_blocks -> kv_first).  Layers sharing storage are kept once.
    """
    tensors = list(caches.values()) if isinstance(caches, Mapping) else list(caches)
    out: list[CanonicalKVCacheTensor] = []
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        lay = layout
        if lay == "auto":
            if t.shape[0] == num_blocks and not (num_blocks == 2 and t.ndim > 1 and t.shape[1] == 2):
                lay = "blocks_first"
            elif t.shape[0] == 2 and t.ndim > 1 and t.shape[1] == num_blocks:
                lay = "kv_first"
            else:
                raise ValueError(f"cannot find num_blocks={num_blocks} in shape {tuple(t.shape)}")
        parts = [t] if lay == "blocks_first" else [t[0], t[1]]
        for p in parts:
            key = (p.data_ptr(), p.stride(0))
            if key in seen:
                continue
            seen.add(key)
            r = _rows(p, num_blocks)
            out.append(CanonicalKVCacheTensor(tensor=r, page_size_bytes=r.shape[1]))
    refs = [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=c.page_size_bytes)
            for i, c in enumerate(out)]
    return CanonicalKVCaches(tensors=out, group_data_refs=[refs])


@pytest.fixture
def fresh_seed(record_property):
    """A fresh random seed (or ``KV_TIER_SEED``), printed and recorded for replay."""
    env = os.environ.get("KV_TIER_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(1 << 31)
    record_property("kv_tier_seed", seed)
    print(f"kv tier seed {seed} (replay: KV_TIER_SEED={seed})")
    return seed


def make_worker(kv_caches, num_host_blocks: int, ring_bytes: int, runtime=None,
                worker_cls=IonKVTierWorker, verify: bool = False) -> IonKVTierWorker:
    """A worker with a ring of ``ring_bytes`` (any byte count) and ``num_host_blocks``."""
    slot = sum(c.page_size_bytes for c in kv_caches.tensors)
    cfg = KVTierConfig(host_bytes=max(1, num_host_blocks) * slot,
                       ring_mib=ring_bytes / (1 << 20), verify=verify)
    w = worker_cls(kv_caches, cfg, num_host_blocks, runtime=runtime)
    w.LOG_INTERVAL_S = 0
    return w


def store(w, job, gpu, host):
    w.submit_store(job, GPULoadStoreSpec(list(gpu), [len(gpu)], [0]), IonHostSpec(list(host)))


def load(w, job, host, gpu):
    w.submit_load(job, IonHostSpec(list(host)), GPULoadStoreSpec(list(gpu), [len(gpu)], [0]))


def until_done(rt, w, jobs):
    """Run the simulated streams and poll until every job in ``jobs`` was reported."""
    done = set()
    for _ in range(50):
        rt.run_all()
        done |= {r.job_id for r in w.get_finished()}
        if jobs <= done:
            return done
    raise AssertionError(f"never finished: {jobs - done}")


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
                 page: int = 4, dim: int = 8, device: str = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        """``dtype``: the cache's element type; ``torch.uint8`` is how vLLM allocates an
        fp8 KV cache (the backends view it as e4m3)."""
        self.layout, self.nb, self.dtype = layout, num_blocks, dtype
        self.shape_blk = (hkv, page, dim) if layout == "ion" else (page, hkv, dim)
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.gen = g
        self.layers = []
        for _ in range(num_layers):
            if layout == "ion":
                t = torch.zeros((num_blocks, 2, hkv, page, dim), dtype=dtype)
            else:
                t = torch.zeros((2, num_blocks, page, hkv, dim), dtype=dtype)
            self.layers.append(t.to(device))
        self.canonical = canonicalize_layer_caches(self.layers, num_blocks)

    def _kv(self, t: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (t[b, 0], t[b, 1]) if self.layout == "ion" else (t[0, b], t[1, b])

    def random_block(self) -> list[torch.Tensor]:
        out = []
        for _ in self.layers:
            if self.dtype == torch.uint8:  # every byte pattern, as e4m3 codes
                kv = torch.randint(0, 256, (2, *self.shape_blk), generator=self.gen,
                                   dtype=torch.uint8)
            else:
                kv = torch.randn((2, *self.shape_blk), generator=self.gen).to(self.dtype)
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
            k.fill_(0x7F if self.dtype == torch.uint8 else float("nan"))
            v.fill_(0xC0 if self.dtype == torch.uint8 else -7.0)

    def equal(self, b: int, data: list[torch.Tensor]) -> bool:
        for t, kv in zip(self.layers, data):
            k, v = self._kv(t, b)
            if not (torch.equal(k.cpu().view(torch.uint8), kv[0].view(torch.uint8))
                    and torch.equal(v.cpu().view(torch.uint8), kv[1].view(torch.uint8))):
                return False
        return True


def key_of(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


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
    device: str = "cpu",
    runtime=None,
    verify: bool = False,
) -> HarnessResult:
    """``n_ops`` random store / flush / lookup+load / touch / device-step / poll
    operations, then every block the manager holds restored and compared; a failure
    carries ``seed`` in a note."""
    try:
        return _run(seed, n_ops, layout, num_gpu_blocks, num_host_blocks, ring_slots, window,
                    manager_cls, worker_cls, device, runtime, verify)
    except Exception as e:
        e.add_note(f"run_random_ops seed={seed} (replay with KV_TIER_SEED={seed})")
        raise


class _Driver:
    """One run of ``run_random_ops``: the manager and the worker under test, and the
    model they are checked against (pending / ready keys with ref counts, LRU order)."""

    def __init__(self, seed, layout, num_gpu_blocks, num_host_blocks, ring_slots, window,
                 manager_cls, worker_cls, device, runtime, verify):
        self.rng = rng = random.Random(seed)
        self.kvm = KVModel(layout, num_gpu_blocks, device=device, seed=seed)
        self.rt = runtime if runtime is not None else SimRuntime(eager=False)
        self.device = device
        slot = sum(c.page_size_bytes for c in self.kvm.canonical.tensors)
        self.worker = make_worker(self.kvm.canonical, num_host_blocks,
                                  ring_slots * slot + slot // 2 if ring_slots else 0,
                                  runtime=self.rt, worker_cls=worker_cls, verify=verify)
        self.budget = num_host_blocks * slot + rng.randrange(slot)
        self.num_host_blocks, self.window = num_host_blocks, window
        self.mgr = manager_cls(num_host_blocks, slot, self.budget, window)
        self.res = HarnessResult()
        self.truth: dict[int, list[torch.Tensor]] = {}  # key id -> block data
        self.next_key = 0
        self.chains: list[list[int]] = []  # sequences of key ids (prefix chains)
        self.m_pending: set[int] = set()
        self.m_ref: dict[int, int] = {}  # ready keys -> ref count
        self.m_lru: OrderedDict[int, None] = OrderedDict()
        self.m_seq: dict[int, int] = {}  # key id -> order of its (latest) prepare_store
        self.seq_ctr = itertools.count()
        self.gpu_free = list(range(num_gpu_blocks))
        rng.shuffle(self.gpu_free)
        self.stores: dict[int, tuple[list[int], list[int], bool]] = {}  # keys, gpu, flushed
        self.loads: dict[int, tuple[list[int], list[int]]] = {}
        self.job_ctr = 0

    @staticmethod
    def kid(k) -> int:
        return int.from_bytes(k[:8], "big")

    def free_gpu(self, blocks):
        for b in blocks:
            self.kvm.scrub(b)
            self.gpu_free.append(b)

    def check(self):
        self.mgr.check_invariants()
        self.worker.check_invariants()
        got = [self.kid(k) for k in self.mgr.lru_keys()]
        if got != list(self.m_lru):
            raise AssertionError(f"LRU order differs: {got[:8]} vs {list(self.m_lru)[:8]}")
        if self.mgr.used_bytes > self.budget:
            raise AssertionError("host byte budget exceeded")
        if self.worker.ring.alloc.used > self.worker.ring.num_slots:
            raise AssertionError("ring overflow")

    def _idle(self, keys):
        for k in sorted(set(keys), key=self.m_seq.__getitem__, reverse=True):
            if self.m_ref[k] == 0:
                self.m_lru[k] = None

    def poll(self):
        for r in self.worker.get_finished():
            assert r.success
            if r.job_id in self.stores:
                keys, gpu, flushed = self.stores.pop(r.job_id)
                self.mgr.complete_store([key_of(k) for k in keys], CTX)
                for k in keys:
                    self.m_pending.discard(k)
                    self.m_ref[k] = 0
                self._idle(keys)
                if not flushed:
                    self.free_gpu(gpu)
                continue
            keys, gpu = self.loads.pop(r.job_id)
            for k, b in zip(keys, gpu):
                if not self.kvm.equal(b, self.truth[k]):
                    raise Corruption(f"restored block of key {k} differs from the stored one")
                self.res.restored_blocks += 1
            self.mgr.complete_load([key_of(k) for k in keys], CTX)
            for k in keys:
                self.m_ref[k] -= 1
            self._idle(keys)
            self.free_gpu(gpu)

    def _new_keys(self) -> list[int]:
        rng, n = self.rng, self.rng.randint(1, 6)
        if self.chains and rng.random() < 0.4:
            base = rng.choice(self.chains)
            keys = base[: rng.randint(1, len(base))]
            keys = keys + list(range(self.next_key, self.next_key + rng.randint(0, n)))
        else:
            keys = list(range(self.next_key, self.next_key + n))
        for k in keys:
            if k >= self.next_key:
                self.truth[k] = self.kvm.random_block()
        self.next_key = max([self.next_key] + [k + 1 for k in keys])
        self.chains.append(keys)
        if len(self.chains) > 64:
            self.chains.pop(0)
        return keys

    def do_store(self):
        keys = self._new_keys()
        if len(self.gpu_free) < len(keys):
            return
        gpu = [self.gpu_free.pop() for _ in keys]
        for k, b in zip(keys, gpu):
            self.kvm.write(b, self.truth[k])
        # expected behaviour from the model
        new = [k for k in dict.fromkeys(keys) if k not in self.m_pending and k not in self.m_ref]
        room = max(0, self.window - len(self.m_pending))
        exp_drop = max(0, len(new) - room)
        new = new[:room]
        need = len(new) - (self.num_host_blocks - len(self.m_pending) - len(self.m_ref))
        exp_evict = [k for k in self.m_lru if k not in set(keys)][:need] if need > 0 else []
        out = self.mgr.prepare_store([key_of(k) for k in keys], CTX)
        got_evict = [self.kid(k) for k in out.evicted_keys]
        if got_evict != exp_evict:
            raise AssertionError(f"evicted {got_evict}, LRU model says {exp_evict}")
        for k in exp_evict:
            del self.m_lru[k]
            del self.m_ref[k]
        stored = [self.kid(k) for k in out.keys_to_store]
        for k in stored:
            self.m_seq[k] = next(self.seq_ctr)
        no_space = max(0, need - len(exp_evict))
        if stored != new[: len(new) - no_space]:
            raise AssertionError(f"stored {stored}, expected {new[: len(new) - no_space]}")
        res = self.res
        res.evicted_blocks += len(exp_evict)
        res.dropped_blocks += exp_drop
        res.no_space_blocks += no_space
        res.stored_blocks += len(stored)
        self.m_pending.update(stored)
        kept = [(k, b) for k, b in zip(keys, gpu) if k in set(stored)]
        self.free_gpu([b for k, b in zip(keys, gpu) if k not in set(stored)])
        if kept:
            self.job_ctr += 1
            src = GPULoadStoreSpec([b for _, b in kept], group_sizes=[len(kept)],
                                   block_indices=[0])
            self.worker.submit_store(self.job_ctr, src, out.store_spec)
            self.stores[self.job_ctr] = ([k for k, _ in kept], [b for _, b in kept], False)

    def do_flush(self):
        cand = [j for j, (_, _, f) in self.stores.items() if not f]
        if not cand:
            return
        jobs = set(self.rng.sample(cand, self.rng.randint(1, min(3, len(cand)))))
        self.worker.wait(jobs)
        for j in jobs:
            keys, gpu, _ = self.stores[j]
            self.stores[j] = (keys, gpu, True)
            self.free_gpu(gpu)  # vLLM may reuse the source blocks right after wait()

    def _touch(self, keys):
        self.mgr.touch([key_of(k) for k in keys], CTX)
        for k in reversed(keys):
            if k in self.m_lru:
                self.m_lru.move_to_end(k)

    def _load(self, keys) -> int:
        spec = self.mgr.prepare_load([key_of(k) for k in keys], CTX)
        for k in keys:
            if self.m_ref[k] == 0:
                del self.m_lru[k]
            self.m_ref[k] += 1
        gpu = [self.gpu_free.pop() for _ in keys]
        for b in gpu:
            self.kvm.scrub(b)
        if self.device == "cuda":  # the garbage is old by the time vLLM loads into a block:
            torch.cuda.current_stream().synchronize()  # loads wait for no compute work
        self.job_ctr += 1
        self.worker.submit_load(self.job_ctr, spec, GPULoadStoreSpec(
            gpu, group_sizes=[len(gpu)], block_indices=[0]))
        self.loads[self.job_ctr] = (list(keys), gpu)
        return self.job_ctr

    def do_lookup_load(self):
        if not self.chains:
            return
        chain = self.rng.choice(self.chains)
        hits = []
        for k in chain:
            r = self.mgr.lookup(key_of(k), CTX)
            exp = (LookupResult.HIT if k in self.m_ref else
                   LookupResult.HIT_PENDING if k in self.m_pending else LookupResult.MISS)
            if r != exp:
                raise AssertionError(f"lookup({k}) = {r}, expected {exp}")
            if r != LookupResult.HIT:
                break
            hits.append(k)
        self._touch(chain)
        hits = list(dict.fromkeys(hits))[: self.rng.randint(1, 4)]
        if hits and len(self.gpu_free) >= len(hits):
            self._load(hits)

    def do_touch(self):
        if self.truth:
            self._touch([self.rng.randrange(self.next_key)
                         for _ in range(self.rng.randint(1, 5))])

    def do_tick(self):
        if hasattr(self.rt, "step"):
            self.rt.step(self.rng, self.rng.randint(1, 12))

    def quiesce_and_restore_all(self):
        """Let every transfer finish, then restore every block the manager holds."""
        for _ in range(10000):
            if hasattr(self.rt, "run_all"):
                self.rt.run_all()
            elif self.device == "cuda":
                torch.cuda.synchronize()
            self.poll()
            if not self.stores and not self.loads:
                break
        assert not self.stores and not self.loads, "transfers never completed"
        self.check()
        ready = list(self.m_ref)
        for i in range(0, len(ready), 8):
            ks = ready[i:i + 8]
            if len(self.gpu_free) < len(ks):
                break
            self.worker.wait({self._load(ks)})
            self.poll()
            self.res.verified_blocks += len(ks)
        self.check()

    def check_counters(self):
        """The counters agree with the model and with each other."""
        res, c, ws = self.res, self.mgr.counters, self.worker.stats
        assert c.stored_blocks == res.stored_blocks, "stored counter drift"
        assert c.completed_store_blocks == res.stored_blocks, "completed counter drift"
        assert c.evicted_blocks == res.evicted_blocks, "evicted counter drift"
        assert c.store_dropped_blocks == res.dropped_blocks, "dropped counter drift"
        assert c.store_no_space_blocks == res.no_space_blocks, "no-space counter drift"
        assert ws.drained_blocks + ws.spill_blocks == res.stored_blocks, \
            "worker store count drift"
        assert ws.d2d_blocks == ws.drained_blocks, "ring d2d/drain count drift"
        assert ws.loaded_blocks == c.loaded_blocks == res.restored_blocks, "load count drift"
        assert ws.ring_peak_slots <= self.worker.ring.num_slots
        assert len(self.m_ref) == self.mgr.used_blocks


OPS = (("store", 5), ("flush", 2), ("lookup_load", 4), ("touch", 1), ("tick", 5),
       ("poll", 4))


def _run(seed, n_ops, *args) -> HarnessResult:
    d = _Driver(seed, *args)
    names, weights = [o[0] for o in OPS], [o[1] for o in OPS]
    for _ in range(n_ops):
        name = d.rng.choices(names, weights)[0]
        getattr(d, name if name == "poll" else f"do_{name}")()
        d.res.ops[name] = d.res.ops.get(name, 0) + 1
        d.check()
    d.quiesce_and_restore_all()
    d.check_counters()
    d.res.worker_stats = d.worker.stats.as_dict()
    return d.res
