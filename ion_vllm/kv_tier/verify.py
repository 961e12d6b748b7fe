"""Block verification (the ``verify`` key; a test mode: GPU time and a host sync per
finished load).  A store fingerprints its GPU source blocks on the stream that reads them,
before vLLM may reuse them, keyed by host block id (a rewrite replaces the fingerprint);
a load takes its host blocks' fingerprints at submit and, once its copy has completed,
fingerprints the destination GPU blocks on a stream of its own, reads them back and
compares: ``verified_blocks``, ``verify_mismatch_blocks`` (logged at error level, and
reported to vLLM as invalid blocks, so they are recomputed, not used).  This
checks the bytes through ring, host pool and restore; which key lives in which host block
is the manager's bookkeeping, checked by the scheduler tests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ion_vllm.kv_tier.copies import group_runs
from ion_vllm.kv_tier.page_gather import device_ids
from ion_vllm.kv_tier.stats import PROCESS_COUNTERS, WorkerStats

logger = logging.getLogger(__name__)

FP_PRIME = (1 << 31) - 1  # Mersenne prime


class BlockFingerprinter:
    """Fingerprint of a KV block as it sits in a host row, computed with plain torch
    integer ops on any device (exact, so CPU and CUDA agree bit for bit).

    The row's bytes are read as words ``w_i`` (unsigned 16-bit, or bytes when some page
    size or offset is odd), ``i`` = word index within the row; the fingerprint is
    ``(sum w_i mod P) * P + (sum (i + 1) * w_i mod P)`` with P = 2^31 - 1.  A changed word
    changes the second sum by ``(i + 1) * delta``, both factors nonzero and below the
    prime, so it is always caught; so is a swap of two different words (``(i - j) * (w_j -
    w_i)``), hence swapped rows / layers / K and V.  The per-tensor parts use the tensor's
    offset in the row, so GPU blocks (one row per canonical tensor) and a host row give
    the same value.
    """

    CHUNK_BYTES = 64 << 20  # bound on the int64 temporaries of one call

    def __init__(self, page_bytes: Sequence[int], offsets: Sequence[int]):
        self.page_bytes = [int(x) for x in page_bytes]
        self.offsets = [int(x) for x in offsets]
        even = all(x % 2 == 0 for x in self.page_bytes + self.offsets)
        self.word = 2 if even else 1
        self._weights: dict[tuple[int, int, str], torch.Tensor] = {}

    def prepare(self, device: torch.device) -> None:
        """Build the position weights of every canonical tensor now (then synchronized), so
        that fingerprints on other streams never read weights still being written."""
        for off, nb in zip(self.offsets, self.page_bytes):
            self._w(off // self.word, nb // self.word, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _w(self, w0: int, n: int, device: torch.device) -> torch.Tensor:
        key = (w0, n, str(device))
        w = self._weights.get(key)
        if w is None:
            w = torch.arange(w0 + 1, w0 + 1 + n, dtype=torch.int64, device=device)
            self._weights[key] = w
        return w

    def part(self, rows: torch.Tensor, byte_offset: int) -> torch.Tensor:
        """(n, 2) int64 partial sums (each < 2^62) of int8 rows (n, nbytes) that sit at
        byte_offset of their host rows."""
        assert rows.dtype == torch.int8 and rows.ndim == 2
        n, nb = rows.shape
        if nb % self.word or byte_offset % self.word:
            raise ValueError("fingerprint: rows not aligned to the word size")
        out = torch.zeros((n, 2), dtype=torch.int64, device=rows.device)
        if nb == 0 or n == 0:
            return out
        rows = rows.contiguous()
        words = rows.view(torch.int16) if self.word == 2 else rows
        bias = 1 << (8 * self.word - 1)
        wt = self._w(byte_offset // self.word, words.shape[1], rows.device)
        step = max(1, self.CHUNK_BYTES // (8 * words.shape[1]))
        for a in range(0, n, step):
            x = words[a:a + step].to(torch.int64) + bias  # 0 <= x < 2^16
            out[a:a + step, 0] = x.sum(1)
            out[a:a + step, 1] = ((x * wt) % FP_PRIME).sum(1)
        return out

    @staticmethod
    def finish(acc: torch.Tensor) -> torch.Tensor:
        """(n, 2) partial sums -> (n, 2) int64 fingerprint pair, reduced mod P."""
        return acc % FP_PRIME

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Fingerprints (n, 2) of whole host rows (a host pool / ring view)."""
        return self.finish(self.part(rows, 0))

    @staticmethod
    def to_ints(fp: torch.Tensor) -> list[int]:
        """(n, 2) fingerprint pairs -> one int per block."""
        return [int(a) * FP_PRIME + int(b) for a, b in fp.cpu().tolist()]


class FpBatch:
    """Fingerprints of a run of blocks, computed on a stream; readable once ``event``
    (recorded after the computation) has completed."""

    __slots__ = ("event", "tensor", "values")

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.event: Any = None
        self.values: list[int] | None = None


class BlockVerifier:
    """The worker's verify mode (module docstring): fingerprints of stored blocks by host
    block id, and the check of every finished load."""

    def __init__(self, rt: Any, tensors: list[torch.Tensor], page_bytes: list[int],
                 offsets: list[int], group_refs: list[list[tuple[int, int]]],
                 stats: WorkerStats):
        self.rt, self.tensors, self.offsets = rt, tensors, offsets
        self.group_refs, self.stats = group_refs, stats
        self.device = tensors[0].device
        self.fpr = BlockFingerprinter(page_bytes, offsets)
        self.stream = rt.new_stream()
        self.fpr.prepare(self.device)
        self.by_host: dict[int, tuple[FpBatch, int]] = {}
        logger.warning("Ion KV tier: verify mode on: every stored and restored KV block is "
                       "fingerprinted on %s and compared; this costs GPU time and a sync "
                       "per finished load - a test mode", self.device)

    def fingerprint_gpu(self, groups: np.ndarray, gpu: np.ndarray) -> torch.Tensor:
        """(n, 2) fingerprints of GPU blocks ``gpu`` (of KV groups ``groups``), computed on
        the current stream from the bytes the copies move."""
        idx = device_ids(gpu, self.device)
        acc = torch.zeros((len(gpu), 2), dtype=torch.int64, device=self.device)
        for g, i0, i1 in group_runs(groups, 0, len(gpu)):
            for t, nb in self.group_refs[g]:
                rows = self.tensors[t].index_select(0, idx[i0:i1])[:, :nb]
                acc[i0:i1] += self.fpr.part(rows, self.offsets[t])
        return self.fpr.finish(acc)

    def _queue(self, stream: Any, groups: np.ndarray, gpu: np.ndarray) -> FpBatch:
        fp = FpBatch()

        def run():
            fp.tensor = self.fingerprint_gpu(groups, gpu)

        self.rt.launch(stream, run)
        return fp

    def resolve(self, fp: FpBatch) -> list[int]:
        """Wait for ``fp``'s computation, read its values back once and free the device
        copy.  On CUDA the copy goes through the verify stream, which holds no unfinished
        work here, so the host never waits on the forward pass."""
        if fp.values is None:
            self.rt.sync(fp.event)
            t = fp.tensor
            assert t is not None, "fingerprint never computed"
            if t.is_cuda and isinstance(self.stream, torch.cuda.Stream):
                with torch.cuda.stream(self.stream):
                    t = t.cpu()
            fp.values = BlockFingerprinter.to_ints(t)
            fp.tensor = None
        return fp.values

    def store(self, stream: Any, groups: np.ndarray, gpu: np.ndarray,
              host: np.ndarray) -> FpBatch:
        """Queue the fingerprints of source blocks ``gpu`` on the stream that reads them
        for their copy (the caller sets ``event`` to that copy's read-done event) and key
        them by their host block ids (replacing older fingerprints)."""
        fp = self._queue(stream, groups, gpu)
        for k, h in enumerate(host.tolist()):
            self.by_host[h] = (fp, k)
        self.stats.fingerprinted_store_blocks += len(gpu)
        return fp

    def expect(self, host: np.ndarray) -> list[tuple[FpBatch, int] | None]:
        """The fingerprints a load of host blocks ``host`` must restore (taken now, at
        submit: a later store into those host blocks must not change them)."""
        return [self.by_host.get(h) for h in host.tolist()]

    def check_load(self, job_id: int, groups: np.ndarray, gpu: np.ndarray,
                   host: np.ndarray, expected: list, end: Any) -> list[int]:
        """The host -> GPU copy of a load (its event ``end``) has completed: fingerprint
        the destination blocks on the verify stream, read them back and compare.  Returns
        the positions (into ``gpu``) that differ or have no stored fingerprint: the worker
        reports them to vLLM as invalid."""
        self.rt.wait_event(self.stream, end)
        got = self._queue(self.stream, groups, gpu)
        got.event = self.rt.record(self.stream)
        values = self.resolve(got)
        bad: list[int] = []
        for k, (exp, h, g) in enumerate(zip(expected, host.tolist(), gpu.tolist())):
            if exp is None:
                self.stats.verify_unknown_blocks += 1
                bad.append(k)
                logger.error("Ion KV tier VERIFY: load job %d restored host block %d into "
                             "GPU block %d, but no store of that host block was seen",
                             job_id, h, g)
                continue
            want = self.resolve(exp[0])[exp[1]]
            if values[k] != want:
                bad.append(k)
                logger.error("Ion KV tier VERIFY MISMATCH: load job %d, host block %d -> "
                             "GPU block %d: restored fingerprint %#x != stored %#x",
                             job_id, h, g, values[k], want)
        self.stats.verified_blocks += len(gpu)
        self.stats.verify_mismatch_blocks += len(bad)
        PROCESS_COUNTERS.verified_blocks += len(gpu)
        PROCESS_COUNTERS.verify_mismatch_blocks += len(bad)
        return bad

    def summary(self) -> None:
        st = self.stats
        (logger.error if st.verify_mismatch_blocks else logger.warning)(
            "Ion KV tier VERIFY summary: %d restored blocks checked, %d mismatched "
            "(%d without a stored fingerprint), %d stored blocks fingerprinted",
            st.verified_blocks, st.verify_mismatch_blocks, st.verify_unknown_blocks,
            st.fingerprinted_store_blocks)
