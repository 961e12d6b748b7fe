"""Guards on vLLM 0.26's OffloadingConnector: an engine crash the Ion tier reaches more
often than vLLM's default policy does, and the load-failure contract the connector does
not wire up (``install_load_error_reporting``, at the end).

The crash (vLLM's own scheduler-side code): a request is looked up (which clears the
connector's record of its GPU block ids), finds no room and waits, and is then aborted (a
client disconnects, the server shuts down).  ``request_finished`` extends its offload keys
to every block full by token count, and the next ``_build_store_jobs`` slices as many GPU
block ids as keys beyond what was stored, finds the cleared list, and fails ``assert
len(offload_keys) == len(offload_block_ids)``: EngineCore dies.  Two ways in:
* a new request waiting for room after its lookup, with at least one full prompt block
  (any store policy, vLLM's default included);
* a preempted request tried for readmission, whose final sampled token completes a block
  (policies that store past the prompt: Ion's default, vLLM's
  ``offload_prompt_only: false``).
The second is hit when a benchmark's time limit shuts
an engine down with preempted requests waiting; ``tests/test_kv_tier_abort_waiting.py``
reproduces both through vLLM's Scheduler on the CPU.

The guard: after vLLM's ``request_finished``, chunks of a finished request that have no GPU
block left to copy from are marked as not to be stored (``next_stored_chunk_idx`` moved past
them).  A waiting request holds no GPU blocks, so nothing storable is skipped: a new one
computed nothing, a preempted one had what it computed stored or flushed when it was
preempted.  A request that finished while running keeps its block ids and is not touched.
Installed by the Ion spec on the scheduler side (``IonKVTierSpec.get_manager``), once per
process.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_MARK = "_ion_abort_guard"


def skip_chunks_without_gpu_blocks(req_status: Any, blocks_per_chunk: int) -> int:
    """Move each KV group's ``next_stored_chunk_idx`` of a finished request past the
    chunks whose GPU block ids the connector no longer holds (its block id list is shorter
    than its keys need).  Pure bookkeeping on vLLM's ``RequestOffloadState``; returns the
    number of chunks skipped (0 when every chunk still has its blocks)."""
    skipped = 0
    for state in req_status.group_states:
        keys = len(state.offload_keys)
        if len(state.block_ids) >= keys * blocks_per_chunk:
            continue
        if state.next_stored_chunk_idx < keys:
            skipped += keys - state.next_stored_chunk_idx
            state.next_stored_chunk_idx = keys
    return skipped


def _wrap(cls: Any, name: str, make) -> bool:
    """Replace ``cls.name`` by ``make(original)`` once (marked); False if already done."""
    orig = getattr(cls, name)
    if getattr(orig, _MARK, False):
        return False
    fn = make(orig)
    setattr(fn, _MARK, True)
    fn.__wrapped__ = orig  # type: ignore[attr-defined]
    fn.__doc__ = orig.__doc__
    setattr(cls, name, fn)
    return True


def install_abort_guard() -> bool:
    """Wrap vLLM's ``OffloadingConnectorScheduler.request_finished`` with the guard (module
    docstring).  Idempotent; returns whether this call installed it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler)

    def make(orig):
        def request_finished(self, request):
            out = orig(self, request)
            st = self._req_status.get(request.request_id)
            if st is not None:
                n = skip_chunks_without_gpu_blocks(st, self.config.blocks_per_chunk)
                if n:
                    logger.info("Ion KV tier: request %s finished while waiting; %d "
                                "chunk(s) without GPU blocks are not stored",
                                request.request_id, n)
            return out
        return request_finished

    if not _wrap(OffloadingConnectorScheduler, "request_finished", make):
        return False
    logger.info("Ion KV tier: guard installed on OffloadingConnectorScheduler."
                "request_finished (abort of a waiting request)")
    return True


def install_load_error_reporting() -> None:
    """vLLM's scheduler recomputes (``kv_load_failure_policy: recompute``) or fails the
    blocks a connector names in ``get_block_ids_with_load_errors``, but vLLM 0.26's
    OffloadingConnector never names any.  Two wrappers, both inert for other specs:

    * worker side: ``OffloadingConnector.get_block_ids_with_load_errors`` returns what an
      Ion worker's ``take_invalid_block_ids`` reports (worker.py, "Failures");
    * scheduler side: ``OffloadingConnectorScheduler.update_connector_output``, when the
      step reports invalid blocks, drops the host copies of the load jobs completed in that
      step from an Ion manager (``IonKVTierManager.drop``), so that the recomputed blocks
      are not restored from the same bad copy again.  The output names GPU blocks, not
      jobs, so every load job the step completed is dropped: a few good copies may go too,
      which costs a re-store, never a wrong block.
    Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector)

    def make_errors(orig):
        def get_block_ids_with_load_errors(self):
            worker = getattr(getattr(self, "connector_worker", None), "worker", None)
            take = getattr(worker, "take_invalid_block_ids", None)
            return take() if take is not None else orig(self)
        return get_block_ids_with_load_errors

    def make_update(orig):
        def update_connector_output(self, connector_output):
            drop = getattr(self.manager, "drop", None)
            meta = connector_output.kv_connector_worker_meta
            keys: set = set()
            if drop is not None and connector_output.invalid_block_ids and meta is not None:
                for jid in getattr(meta, "completed_jobs", {}):
                    job = self._jobs.get(jid)
                    if job is not None and not job.is_store:
                        keys |= job.keys
            out = orig(self, connector_output)
            if keys:
                n = drop(keys)
                logger.warning("Ion KV tier: %d GPU block(s) failed to restore; %d host "
                               "cop(ies) dropped, vLLM recomputes the blocks",
                               len(connector_output.invalid_block_ids), n)
            return out
        return update_connector_output

    _wrap(OffloadingConnector, "get_block_ids_with_load_errors", make_errors)
    _wrap(OffloadingConnectorScheduler, "update_connector_output", make_update)
