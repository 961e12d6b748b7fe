"""Scheduler-side bookkeeping of the Ion KV tier's pinned host pool.

One offload chunk is one vLLM KV block (``blocks_per_chunk == 1``); a host
block holds the block's bytes of every layer of one worker (TP ranks keep their
own shard in their own host pool under the same host block id).

State of a host block (``_Entry``):
  * ``ref == -1``  store in flight (prepared, not completed): HIT_PENDING,
                   neither loadable nor evictable;
  * ``ref == 0``   ready and idle: loadable, evictable, sits in ``_lru``;
  * ``ref  > 0``   ready, ``ref`` loads in flight: loadable, not evictable.

LRU: ``_lru`` holds exactly the idle blocks, least recently used first.  A
block becomes most recently used when its store completes, when its last load
completes and when it is touched.  ``touch(keys)`` walks the keys backwards, so
the first block of a sequence ends up the most recent one: a request's tail is
evicted before its prefix, which keeps a prefix hit useful.  vLLM's scheduler
hands ``complete_store``/``complete_load`` an unordered ``set`` of keys, so
blocks that become idle together are queued by their store order (``seq``,
assigned in ``prepare_store``), latest first: the same tail-first order.

Back-off: at most ``max_inflight_blocks`` blocks may be prepared but not yet
completed (the writeback window; config.default_window_bytes).  Blocks above that
are dropped from ``prepare_store`` (counted) instead of queueing unbounded work
behind the forward pass; the scheduler then simply never stores them for this
request.

Finished requests: vLLM's ``OffloadingManager.on_request_finished`` contract says
no ``prepare_store`` follows it, but vLLM 0.26's OffloadingConnectorScheduler
offers a finished request's blocks once more on the next step, counting
``req.num_tokens`` as computed.  The only blocks that call can add are the ones
that the final sampled token completes (or, after an abort mid-prefill, blocks
never prefilled), and their last slots hold no computed KV: storing them would
let a later prefix hit load garbage for those positions.  ``prepare_store``
therefore refuses every key of a request that finished (counted as
``store_after_finish_blocks``); the follow-up request recomputes that block.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Collection, Iterable

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from ion_vllm.kv_tier.config import KVTierConfig
from ion_vllm.kv_tier.stats import M, ManagerCounters, add_counter_growth
from ion_vllm.kv_tier.trace_ranges import traced

#: (metric, ``ManagerCounters`` field) exported as counters by ``get_stats``
_COUNTER_METRICS = (
    (M.LOOKUP_BLOCKS, "lookup_blocks"),
    (M.LOOKUP_HIT_BLOCKS, "lookup_hit_blocks"),
    (M.LOADED_BLOCKS, "loaded_blocks"),
    (M.STORED_BLOCKS, "completed_store_blocks"),
    (M.STORE_DROPPED_BLOCKS, "store_dropped_blocks"),
    (M.STORE_NO_SPACE_BLOCKS, "store_no_space_blocks"),
    (M.STORE_AFTER_FINISH_BLOCKS, "store_after_finish_blocks"),
    (M.EVICTED_BLOCKS, "evicted_blocks"),
)
_counter_values = operator.attrgetter(*(f for _, f in _COUNTER_METRICS))
#: gauges ``get_stats`` reports: host bytes used, host pool usage, in-flight share
_GAUGE_METRICS = (M.HOST_USED_BYTES, M.HOST_USAGE_PERC, M.INFLIGHT_STORE_PERC)

MEDIUM = "CPU"


class IonHostSpec(BlockIDsLoadStoreSpec):
    """Host block ids of the Ion pinned pool (one id per KV block)."""


class _Entry:
    __slots__ = ("block_id", "ref", "seq", "dropped")

    def __init__(self, block_id: int, seq: int = 0):
        self.block_id = block_id
        self.ref = -1
        self.seq = seq  # prepare_store order (sequence position within a job)
        self.dropped = False  # a restore of it failed: removed once its loads complete

    @property
    def ready(self) -> bool:
        return self.ref >= 0


class IonKVTierManager(OffloadingManager):
    def __init__(
        self,
        num_host_blocks: int,
        block_bytes: int,
        host_bytes_budget: int,
        max_inflight_blocks: int,
        enable_events: bool = False,
    ):
        if num_host_blocks * block_bytes > host_bytes_budget:
            raise ValueError("host pool larger than its byte budget")
        if max_inflight_blocks < 1:
            raise ValueError("max_inflight_blocks must be >= 1")
        self.num_host_blocks = num_host_blocks
        self.block_bytes = block_bytes
        self.host_bytes_budget = host_bytes_budget
        self.max_inflight_blocks = max_inflight_blocks
        self._entries: dict[OffloadKey, _Entry] = {}
        self._lru: OrderedDict[OffloadKey, None] = OrderedDict()
        # Free host block ids, kept sorted descending so pop() gives the lowest
        # id: consecutive stores get consecutive host blocks, which the worker
        # coalesces into few large D2H copies.
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._free_sorted = True
        self._inflight = 0
        self._seq = 0
        self.counters = ManagerCounters()
        self._reported = _counter_values(self.counters)
        self._reported_gauges = (None,) * len(_GAUGE_METRICS)  # the first call sends all
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # ids of finished requests, by the scheduler step they finished in: the
        # scheduler's post-finish prepare_store comes in the step after the finish,
        # right after on_schedule_end (both in build_connector_meta); keeping the ids of
        # the last two steps covers it and bounds the memory
        self._finished_new: set[str] = set()  # since the last on_schedule_end
        self._finished_prev: set[str] = set()  # in the step before

    @classmethod
    def from_config(cls, config: KVTierConfig, worker_block_bytes: int, world: int,
                    enable_events: bool = False):
        """The manager of a tier of ``world`` workers whose KV blocks are
        ``worker_block_bytes`` each (a host block holds every worker's share)."""
        block_bytes = worker_block_bytes * max(1, world)
        return cls(num_host_blocks=config.host_blocks(block_bytes), block_bytes=block_bytes,
                   host_bytes_budget=config.host_bytes,
                   max_inflight_blocks=config.window_blocks(worker_block_bytes, world),
                   enable_events=enable_events)

    # ------------------------------------------------------------ helpers
    @property
    def used_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    @property
    def inflight_blocks(self) -> int:
        return self._inflight

    def lru_keys(self) -> list[OffloadKey]:
        return list(self._lru)

    def _take_free(self, n: int) -> list[int]:
        if not self._free_sorted:
            self._free.sort(reverse=True)
            self._free_sorted = True
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def _give_free(self, block_id: int) -> None:
        self._free.append(block_id)
        self._free_sorted = False

    def _make_idle(self, keys: list[OffloadKey]) -> None:
        """Append keys that just became idle to the LRU, latest-stored first, so
        a sequence's prefix ends up more recent than its tail."""
        for key in sorted(keys, key=lambda k: self._entries[k].seq, reverse=True):
            self._lru[key] = None

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=keys, medium=MEDIUM, removed=removed))

    # ------------------------------------------------------------ interface
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._finished_new.add(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        self._finished_prev = self._finished_new
        self._finished_new = set()

    def _is_finished(self, req_id: str) -> bool:
        return req_id in self._finished_new or req_id in self._finished_prev

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters.lookup_blocks += 1
        e = self._entries.get(key)
        if e is None or e.dropped:
            return LookupResult.MISS
        self.counters.lookup_hit_blocks += 1
        return LookupResult.HIT if e.ready else LookupResult.HIT_PENDING

    @traced("ion_kv:prepare_load")
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> IonHostSpec:
        ids = []
        for key in keys:
            e = self._entries.get(key)
            assert e is not None and e.ready, f"block {key!r} not loadable"
            if e.ref == 0:
                del self._lru[key]
            e.ref += 1
            ids.append(e.block_id)
        self.counters.loaded_blocks += len(ids)
        return IonHostSpec(ids)

    @traced("ion_kv:touch")
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            if key in self._lru:
                self._lru.move_to_end(key)

    @traced("ion_kv:complete_load")
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        idle: list[OffloadKey] = []
        for key in keys:
            e = self._entries.get(key)
            assert e is not None and e.ref > 0, f"block {key!r} was not being loaded"
            e.ref -= 1
            if e.ref == 0:
                idle.append(key)
        gone = [k for k in idle if self._entries[k].dropped]
        for k in gone:
            self._give_free(self._entries.pop(k).block_id)
        self._emit(gone, removed=True)
        self._make_idle([k for k in idle if k in self._entries])

    def drop(self, keys: Collection[OffloadKey]) -> int:
        """Forget the host copies of ``keys`` (a restore of them was reported invalid, so
        vLLM recomputes them and a later lookup must miss, not load them again): idle ones
        now, ones still being loaded when their last load completes.  Keys unknown or
        still being stored are left alone.  Returns how many were dropped."""
        now: list[OffloadKey] = []
        n = 0
        for key in keys:
            e = self._entries.get(key)
            if e is None or not e.ready or e.dropped:
                continue
            n += 1
            e.dropped = True
            if e.ref == 0:
                del self._lru[key]
                self._give_free(self._entries.pop(key).block_id)
                now.append(key)
        self._emit(now, removed=True)
        self.counters.dropped_blocks += n
        return n

    @traced("ion_kv:prepare_store")
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        wanted: list[OffloadKey] = []
        seen: set[OffloadKey] = set()
        for k in keys:
            if k not in self._entries and k not in seen:
                wanted.append(k)
                seen.add(k)

        # A finished request's last offer: its new blocks end in uncomputed KV (module doc).
        if wanted and self._is_finished(req_context.req_id):
            self.counters.store_after_finish_blocks += len(wanted)
            return PrepareStoreOutput(keys_to_store=[], store_spec=IonHostSpec([]),
                                      evicted_keys=[])

        # Back-off 1: bounded writeback window (keep the prefix of the list).
        room = max(0, self.max_inflight_blocks - self._inflight)
        if len(wanted) > room:
            self.counters.store_dropped_blocks += len(wanted) - room
            wanted = wanted[:room]

        # Back-off 2: host space; evict idle LRU blocks, never one of `keys`.
        protected = set(keys)
        need = len(wanted) - len(self._free)
        evicted: list[OffloadKey] = []
        if need > 0:
            for k in self._lru:
                if len(evicted) == need:
                    break
                if k not in protected:
                    evicted.append(k)
            for k in evicted:
                del self._lru[k]
                self._give_free(self._entries.pop(k).block_id)
            self.counters.evicted_blocks += len(evicted)
            if len(wanted) > len(self._free):
                self.counters.store_no_space_blocks += len(wanted) - len(self._free)
                wanted = wanted[: len(self._free)]
        self._emit(evicted, removed=True)

        ids = self._take_free(len(wanted))
        for k, b in zip(wanted, ids):
            self._entries[k] = _Entry(b, self._seq)
            self._seq += 1
        self._inflight += len(wanted)
        self.counters.stored_blocks += len(wanted)
        return PrepareStoreOutput(
            keys_to_store=wanted, store_spec=IonHostSpec(ids), evicted_keys=evicted
        )

    @traced("ion_kv:complete_store")
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        done: list[OffloadKey] = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.ready:
                continue
            self._inflight -= 1
            if success:
                e.ref = 0
                done.append(key)
                self.counters.completed_store_blocks += 1
            else:
                del self._entries[key]
                self._give_free(e.block_id)
                self.counters.failed_store_blocks += 1
        self._make_idle(done)
        self._emit(done, removed=False)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            ev, self._events = self._events, []
            yield from ev

    def reset_cache(self) -> None:
        self._entries.clear()
        self._lru.clear()
        self._free = list(range(self.num_host_blocks - 1, -1, -1))
        self._free_sorted = True
        self._inflight = 0

    @traced("ion_kv:get_stats")
    def get_stats(self):
        """The counters' growth since the last call, and each gauge whose value changed
        since the last call that sent it.  vLLM calls this every engine step and
        drops an empty result (``Scheduler.update_from_output``), so a step in which
        nothing moved, most decode steps, costs two tuple comparisons and sends no
        payload; a Prometheus gauge keeps its last value meanwhile.  (vLLM's own manager
        sets its gauges every step.)"""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        s = OffloadingConnectorStats()
        self._reported = add_counter_growth(s, _COUNTER_METRICS, _counter_values(self.counters),
                                            self._reported)
        n = self.num_host_blocks
        gauges = (self.used_bytes, len(self._entries) / n if n else 0.0,
                  self._inflight / self.max_inflight_blocks)
        if gauges != self._reported_gauges:
            for name, v, was in zip(_GAUGE_METRICS, gauges, self._reported_gauges):
                if v != was:
                    s.set_gauge(name, v)
            self._reported_gauges = gauges
        return s

    # ------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent."""
        ids = [e.block_id for e in self._entries.values()]
        assert len(ids) == len(set(ids)), "host block shared by two keys"
        assert not set(ids) & set(self._free), "host block both used and free"
        assert len(ids) + len(self._free) == self.num_host_blocks, "host block leaked"
        assert self.used_bytes <= self.host_bytes_budget, "host byte budget exceeded"
        idle = {k for k, e in self._entries.items() if e.ref == 0}
        assert not any(e.dropped and e.ref <= 0 for e in self._entries.values()), \
            "dropped block still held"
        assert idle == set(self._lru), "LRU list != idle blocks"
        pending = sum(1 for e in self._entries.values() if e.ref < 0)
        assert pending == self._inflight, "in-flight count drift"
        assert self._inflight <= self.max_inflight_blocks, "writeback window exceeded"
