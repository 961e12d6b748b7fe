"""The planner's work list on the device, in buffers allocated once (CUDA-graph safe)."""

from __future__ import annotations

import torch

from .options import KernelOptions, tile_ms_for
from .worklist import COMBINE_COLS, WORK_COLS

#: SMs assumed when planning for a device that is not a GPU (H100/H200 SXM)
HOPPER_SMS = 132


def num_sms(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return HOPPER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid_ctas(device, tile_m: int, head_dim: int = 128) -> int:
    """Persistent CTAs of the kernels that run ``tile_m``-row plans on ``device``."""
    return num_sms(device) * KernelOptions(head_dim=head_dim, tile_m=tile_m).ctas_per_sm


class _PinnedStage:
    """Pinned host copy of the plan buffers and the event of its last upload."""

    def __init__(self, item_capacity: int, group_capacity: int, num_ctas: int, pin: bool):
        self.work = torch.zeros((item_capacity, WORK_COLS), dtype=torch.int32, pin_memory=pin)
        self.cta_offsets = torch.zeros(num_ctas + 1, dtype=torch.int32, pin_memory=pin)
        self.partial_offsets = torch.full((item_capacity,), -1, dtype=torch.int32,
                                          pin_memory=pin)
        self.combine = torch.zeros((group_capacity, COMBINE_COLS), dtype=torch.int32,
                                   pin_memory=pin)
        self.num_items = 0
        self.num_groups = 0
        self.event = torch.cuda.Event() if pin else None
        self.recorded = False


class DevicePlan:
    """Device buffers for the plans of one q-tile size, allocated once.

    ``upload(host_plan)`` writes a step's plan into the same buffers (through two alternating
    pinned staging buffers, non-blocking), so launches captured in a CUDA graph stay valid
    on replay.  It also owns the split-KV workspace (``partial_o``/``partial_lse``) and the
    combine group list; plan with ``max_partial_rows=partial_rows_capacity``.
    ``always_combine`` launches the combine pass on every call (needed under graph capture,
    where a later replay may carry split groups).
    """

    def __init__(self, *, item_capacity: int, group_capacity: int, partial_rows_capacity: int,
                 num_ctas: int, head_dim: int, device, tile_m: int = 64,
                 always_combine: bool = False):
        if tile_m not in tile_ms_for(head_dim):
            raise ValueError(f"tile_m must be one of {tile_ms_for(head_dim)} at head size "
                             f"{head_dim}, got {tile_m}")
        device = torch.device(device)
        self.tile_m = int(tile_m)
        self.device = device
        self.num_ctas = int(num_ctas)
        self.item_capacity = max(1, int(item_capacity))
        self.group_capacity = max(1, int(group_capacity))
        self.partial_rows_capacity = int(partial_rows_capacity)
        self.always_combine = bool(always_combine)
        self.work = torch.zeros((self.item_capacity, WORK_COLS), dtype=torch.int32,
                                device=device)
        self.cta_offsets = torch.zeros(self.num_ctas + 1, dtype=torch.int32, device=device)
        self.partial_offsets = torch.full((self.item_capacity,), -1, dtype=torch.int32,
                                          device=device)
        self.combine = torch.zeros((self.group_capacity, COMBINE_COLS), dtype=torch.int32,
                                   device=device)
        rows = max(1, self.partial_rows_capacity)
        self.partial_o = torch.empty((rows, head_dim), dtype=torch.float32, device=device)
        self.partial_lse = torch.empty((rows,), dtype=torch.float32, device=device)
        self.num_items = 0
        self.num_groups = 0
        #: the host plan these buffers hold (``upload`` is their only writer)
        self.host = None
        #: kind of the last uploaded plan: True = KV units for the fused-writeback kernel,
        #: False = cache pages, None = nothing uploaded yet
        self.fresh_kv = None
        #: the sliding window (tokens, 0: none) the last uploaded plan was pruned to
        self.window = None
        pin = device.type == "cuda"
        self._stages = [_PinnedStage(self.item_capacity, self.group_capacity, self.num_ctas,
                                     pin) for _ in range(2)]
        self._next = 0

    def upload(self, host_plan) -> "DevicePlan":
        from .planner import pack_plan

        if host_plan.num_ctas != self.num_ctas:
            raise ValueError(f"plan has {host_plan.num_ctas} CTAs, buffers {self.num_ctas}")
        n = host_plan.n_items
        g = host_plan.combine.shape[0]
        if n > self.item_capacity or g > self.group_capacity:
            raise RuntimeError(f"plan ({n} items, {g} split groups) exceeds the device plan "
                               f"capacity ({self.item_capacity}, {self.group_capacity})")
        if host_plan.tile_m != self.tile_m:
            raise RuntimeError(f"plan has tile_m={host_plan.tile_m}, this DevicePlan runs "
                               f"tile_m={self.tile_m} kernels")
        if host_plan.partial_rows > self.partial_rows_capacity:
            raise RuntimeError(f"plan needs {host_plan.partial_rows} partial rows, workspace "
                               f"holds {self.partial_rows_capacity}")
        stage = self._stages[self._next]
        self._next ^= 1
        if stage.event is not None and stage.recorded:
            stage.event.synchronize()  # the copy that last read this stage has finished
        # rows past this plan must be cleared on the device if an earlier plan used them
        rows = max(n, self.num_items)
        grows = max(g, self.num_groups)
        pack_plan(host_plan, stage.work.numpy(), stage.cta_offsets.numpy(),
                  stage.partial_offsets.numpy(), stage.combine.numpy(),
                  prev_n_items=max(rows, stage.num_items),
                  prev_n_groups=max(grows, stage.num_groups))
        stage.num_items = n
        stage.num_groups = g
        if rows:
            self.work[:rows].copy_(stage.work[:rows], non_blocking=True)
            self.partial_offsets[:rows].copy_(stage.partial_offsets[:rows], non_blocking=True)
        self.cta_offsets.copy_(stage.cta_offsets, non_blocking=True)
        if grows:
            self.combine[:grows].copy_(stage.combine[:grows], non_blocking=True)
        if stage.event is not None:
            stage.event.record()
            stage.recorded = True
        self.num_items = n
        self.num_groups = g
        self.host = host_plan
        self.fresh_kv = bool(host_plan.fresh_kv)
        self.window = int(host_plan.window)
        return self


def make_device_plan(query_start_loc_cpu, seq_lens_cpu, *, num_kv_heads: int,
                     group_size: int, head_dim: int, device, fresh_kv: bool = False,
                     tile_m="auto", num_ctas=None, max_splits: int = 16, cost_model=None,
                     batch_invariant: bool = False, window: int = 0) -> DevicePlan:
    """Plan one batch on the host and place it on ``device`` (plain-PyTorch use; the vLLM
    backend keeps one ``DevicePlan`` per tile size and uploads every step).

    ``fresh_kv=True`` plans KV units for the fused-writeback call (``ion_attention(...,
    key=, value=)``).  ``tile_m``: ``"auto"`` picks 64, 128 or 192 (D = 256: 64 or 128) rows for the batch as the
    vLLM backend does (``cost_model.choose_tile_m``), or force one of them.  ``cost_model``
    (``planner.CostModel``): e.g. one that makes splitting cheap, so tests force split-KV.
    ``batch_invariant``: what the backend plans under ``VLLM_BATCH_INVARIANT=1``: no
    split-KV, packed 64-row tiles, so a token's output does not depend on its batch.
    """
    import numpy as np

    from .cost_model import choose_tile_m
    from .planner import plan

    qsl = np.asarray(query_start_loc_cpu, dtype=np.int32)
    sl = np.asarray(seq_lens_cpu, dtype=np.int32)
    if batch_invariant:
        tile_m = 64
    if tile_m == "auto":
        tile_m = choose_tile_m(qsl, sl, num_q_heads=num_kv_heads * group_size,
                               num_kv_heads=num_kv_heads, head_dim=head_dim,
                               num_ctas=grid_ctas(device, 128, head_dim))
    if num_ctas is None:
        num_ctas = grid_ctas(device, tile_m, head_dim)
    p = plan(qsl, sl, num_kv_heads=num_kv_heads, group_size=group_size, num_ctas=num_ctas,
             tile_m=tile_m, allow_split=not batch_invariant, max_splits=max_splits,
             cost_model=cost_model, fresh_kv=fresh_kv, unpacked_prefill=not batch_invariant,
             window=window)
    dp = DevicePlan(item_capacity=p.n_items, group_capacity=p.combine.shape[0],
                    partial_rows_capacity=p.partial_rows, num_ctas=num_ctas,
                    head_dim=head_dim, device=device, tile_m=tile_m)
    return dp.upload(p)
