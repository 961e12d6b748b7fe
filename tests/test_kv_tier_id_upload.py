"""The reuse rule of the copy kernels' persistent id staging buffer
(``page_gather.StagingRegions``): a region is never handed out while an earlier region
sharing a slot with it is still being read, and refusals happen only then.  Checked
against a slot-by-slot model over random upload sizes and completion orders."""

import numpy as np
import pytest
import torch

from ion_vllm.kv_tier.page_gather import IdUpload, StagingRegions


class _Token:
    def __init__(self):
        self.done = False


def _drive(regions_cls, seed: int, ops: int = 4000, cap: int = 64):
    """Random takes (sizes 1..cap) and completions; returns (takes, refusals) and raises
    AssertionError on a region handed out over a slot still in use, or on a refusal with
    no such slot."""
    rng = np.random.default_rng(seed)
    r = regions_cls(cap)
    owner: list[_Token | None] = [None] * cap  # slot -> token of the region last written
    live: list[_Token] = []
    takes = refusals = 0
    for _ in range(ops):
        if live and rng.random() < 0.45:  # some consumer finishes (any order)
            live.pop(int(rng.integers(len(live)))).done = True
            continue
        n = int(rng.integers(1, cap + 1)) if rng.random() < 0.1 else int(rng.integers(1, 9))
        before = r.pos
        off = r.take(n, lambda t: t.done)
        if off is None:
            refusals += 1
            # a refusal must be forced: some slot the next region would take is in use
            p = before if before + n <= cap else 0
            slots = [(p + i) % cap for i in range(n)]
            assert any(owner[s] is not None and not owner[s].done for s in slots), \
                "refused although every slot of the region was free"
            continue
        assert 0 <= off and off + n <= cap, "region straddles the buffer's end"
        busy = [s for s in range(off, off + n) if owner[s] is not None and not owner[s].done]
        assert not busy, f"slots {busy} handed out while still being read"
        t = _Token()
        r.hold(t)
        for s in range(off, off + n):
            owner[s] = t
        live.append(t)
        takes += 1
    return takes, refusals


@pytest.mark.parametrize("seed", range(6))
def test_regions_never_overlap_a_region_in_use(seed):
    takes, refusals = _drive(StagingRegions, seed)
    assert takes > 1000 and refusals > 10  # both paths exercised


class _IgnoresDone(StagingRegions):
    def take(self, n, done):
        return super().take(n, lambda t: True)


class _WrapsWithoutSkipping(StagingRegions):
    """Mutant: lets a region straddle the end (a real buffer would need two copies)."""

    def take(self, n, done):
        if n < 1 or n > self.capacity:
            return None
        off = self.pos % self.capacity
        self.live = [r for r in self.live if not done(r[2])]
        if any(a < off + n and off < b for a, b, _ in self.live):
            return None
        self._taken = (off, off + n)
        self.pos = off + n
        return off


class _ChecksOnlyTheStart(StagingRegions):
    """Mutant: checks only the region's first slot."""

    def take(self, n, done):
        if n < 1 or n > self.capacity:
            return None
        off = self.pos if self.pos + n <= self.capacity else 0
        self.live = [r for r in self.live if not done(r[2])]
        if any(a <= off < b for a, b, _ in self.live):
            return None
        self._taken = (off, off + n)
        self.pos = off + n
        return off


@pytest.mark.parametrize("mutant", [_IgnoresDone, _WrapsWithoutSkipping, _ChecksOnlyTheStart])
def test_the_model_catches_a_wrong_rule(mutant):
    with pytest.raises(AssertionError):
        _drive(mutant, seed=1)


def test_sizes_out_of_range_and_hold_without_take():
    r = StagingRegions(8)
    assert r.take(0, lambda t: True) is None and r.take(9, lambda t: True) is None
    with pytest.raises(AssertionError, match="hold"):
        r.hold(object())
    with pytest.raises(ValueError):
        StagingRegions(0)


def test_cpu_upload_is_the_ids_themselves():
    up = IdUpload(torch.device("cpu"))
    ids = np.array([5, 2, 9], dtype=np.int64)
    t, staged = up(ids)
    assert not staged and t.dtype == torch.int64 and t.tolist() == [5, 2, 9]
    assert up.staged == 0 and up.fallbacks == 0
