"""The Ion KV tier's configuration: the ``kv_connector_extra_config`` keys it reads,
parsed once into a frozen, validated ``KVTierConfig`` that the spec, the scheduler-side
manager and the worker share (docs/kv_tier.md, "Configuration").

Any other key is refused at start-up with a ``ValueError`` that names it: an unknown key
lists the keys the tier reads; a key of the lab versions (tag ``lab-2026-12``) says it was
removed and what the tier now does, which is what its default was (``REMOVED_KEYS``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the keys the tier reads (``cpu_bytes_to_use`` is required; see KVTierConfig)
KEYS = ("cpu_bytes_to_use", "ring_mib", "max_inflight_mib", "offload_prompt_only", "verify")
#: keys of the same dict that vLLM itself reads (the spec passes them by)
VLLM_KEYS = ("spec_name", "spec_module_path", "block_size", "blocks_per_chunk",
             "self_describing_kv_events")

_FIXED = "removed; the tier now always does what its default did: "
#: removed key -> what the tier does now (or what to use instead)
REMOVED_KEYS = {
    "host_gib": "removed: give the host pool in bytes as 'cpu_bytes_to_use', or in GiB "
                "with vLLM's --kv-offloading-size or ION_KV_TIER_GB",
    "copier": _FIXED + "GPU <-> host copies through vLLM's swap_blocks_batch on CUDA",
    "ring_overflow": _FIXED + "'direct' (blocks the ring has no room for are copied "
                     "GPU -> host at once)",
    "store_completion": _FIXED + "'read' (a store is finished once its GPU blocks are read)",
    "host_layout": _FIXED + "'slot' (one host row per KV block)",
    "ring_gather": _FIXED + "'auto' (the Triton gather kernel on CUDA)",
    "load_copy": _FIXED + "'copier' (loads on the copy engines)",
    "issue_at": _FIXED + "'submit' (GPU work issued inside vLLM's submit calls)",
    "id_upload": _FIXED + "'pin_memory' (block ids through a pinned tensor per launch)",
    "issue_api": "removed; copies are always issued through PyTorch and Triton (the "
                 "ctypes 'raw' path is gone)",
    "gather_priority": _FIXED + "the ring gather runs on vLLM's compute stream",
    "gather_stream": _FIXED + "'compute' (the ring gather on vLLM's compute stream)",
    "gather_ids": _FIXED + "'device' (the gather reads its block ids from device memory)",
    "drain_chunk_kib": _FIXED + "0 (one drain copy per run of host rows)",
    "ring_max_job_blocks": _FIXED + "0 (every store job may use the ring)",
    "store_batch_blocks": _FIXED + "0 (no store batching)",
    "store_batch_steps": _FIXED + "no store batching",
    "host_delay_us": "removed: a test-only probe; tests inject delays themselves",
    "host_delay_at": "removed: a test-only probe; tests inject delays themselves",
    "ring_idle": "removed: a test-only probe; tests inject it themselves",
}

DEFAULT_RING_MIB = 256.0
#: The writeback window (blocks prepared for store whose completion the scheduler has not
#: seen yet) is at least DEFAULT_WINDOW_RINGS rings, else min(DEFAULT_WINDOW_GIB,
#: DEFAULT_WINDOW_HOST_FRACTION x the worker's host pool).  A store completes one to two
#: engine steps after it was prepared, so the window must hold a few steps of new blocks:
#: one 16k-token prefill chunk fills 256 blocks (0.9 GiB of a Qwen2.5-7B KV), and at 4 x a
#: 256 MiB ring the H200 reuse benchmark dropped 47% of its blocks (docs/experiments.md).
#: 4 GiB is ~80 ms of its 51 GB/s drain.  Host memory only: HBM use stays the ring.
DEFAULT_WINDOW_RINGS = 4
DEFAULT_WINDOW_GIB = 4.0
DEFAULT_WINDOW_HOST_FRACTION = 0.25
MIB = 1 << 20


def default_window_bytes(ring_bytes: int, host_bytes_per_worker: int) -> int:
    """Default writeback window of one worker in bytes (see DEFAULT_WINDOW_GIB)."""
    return max(DEFAULT_WINDOW_RINGS * ring_bytes,
               min(int(DEFAULT_WINDOW_GIB * (1 << 30)),
                   int(DEFAULT_WINDOW_HOST_FRACTION * host_bytes_per_worker)))


def _number(key: str, v: Any) -> float:
    """A finite number from JSON (number or numeric string), else a ValueError."""
    try:
        if isinstance(v, bool):
            raise TypeError
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"Ion KV tier: '{key}' must be a number, not {v!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"Ion KV tier: '{key}' must be finite, not {v!r}")
    return x


def _flag(key: str, v: Any) -> bool:
    """A boolean from JSON (true/false, 0/1, or such a string), else a ValueError."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"Ion KV tier: '{key}' must be true or false, not {v!r}")


@dataclass(frozen=True)
class KVTierConfig:
    """The tier's settings (docs/kv_tier.md, "Configuration").

    host_bytes: the pinned host pool of all TP ranks together (``cpu_bytes_to_use``);
    ring_mib: the HBM staging ring of each worker (0: none, every block copied
    GPU -> host directly); max_inflight_mib: the writeback window of each worker (None:
    ``default_window_bytes``); offload_prompt_only: store prompt blocks only (vLLM's
    default) instead of every full block; verify: fingerprint every stored and restored
    block and count mismatches (a test mode: GPU time and a host sync per load)."""

    host_bytes: int
    ring_mib: float = DEFAULT_RING_MIB
    max_inflight_mib: float | None = None
    offload_prompt_only: bool = False
    verify: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.host_bytes, bool) or not isinstance(self.host_bytes, int) \
                or self.host_bytes <= 0:
            raise ValueError("Ion KV tier: 'cpu_bytes_to_use' must be a byte count > 0, "
                             f"not {self.host_bytes!r}")
        if not self.ring_mib >= 0 or not math.isfinite(self.ring_mib):
            raise ValueError("Ion KV tier: 'ring_mib' must be >= 0 (0: no staging ring), "
                             f"not {self.ring_mib!r}")
        if self.max_inflight_mib is not None and not (
                self.max_inflight_mib > 0 and math.isfinite(self.max_inflight_mib)):
            raise ValueError("Ion KV tier: 'max_inflight_mib' must be > 0 (leave it out "
                             f"for the default window), not {self.max_inflight_mib!r}")
        for key in ("offload_prompt_only", "verify"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"Ion KV tier: '{key}' must be true or false")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "KVTierConfig":
        """Parse ``kv_connector_extra_config``; a ValueError naming the key for an
        unknown or removed key, a missing host size or a bad value."""
        for key in extra:
            if key in KEYS or key in VLLM_KEYS:
                continue
            if key in REMOVED_KEYS:
                raise ValueError(f"Ion KV tier: kv_connector_extra_config key '{key}' was "
                                 f"{REMOVED_KEYS[key]}; drop the key")
            raise ValueError(f"Ion KV tier: unknown kv_connector_extra_config key "
                             f"'{key}'; the tier reads {', '.join(KEYS)} (and vLLM "
                             f"itself {', '.join(VLLM_KEYS)})")
        if extra.get("cpu_bytes_to_use") is None:
            raise ValueError("Ion KV tier: set the host pool size with vLLM's "
                             "--kv-offloading-size <GiB>, kv_connector_extra_config "
                             "'cpu_bytes_to_use' (bytes) or ION_KV_TIER_GB")
        host = _number("cpu_bytes_to_use", extra["cpu_bytes_to_use"])
        if host < 1:
            raise ValueError("Ion KV tier: 'cpu_bytes_to_use' must be a byte count > 0, "
                             f"not {extra['cpu_bytes_to_use']!r}")
        kw: dict[str, Any] = {"host_bytes": int(host)}
        if extra.get("ring_mib") is not None:
            kw["ring_mib"] = _number("ring_mib", extra["ring_mib"])
        if extra.get("max_inflight_mib") is not None:
            kw["max_inflight_mib"] = _number("max_inflight_mib", extra["max_inflight_mib"])
        for key in ("offload_prompt_only", "verify"):
            if extra.get(key) is not None:
                kw[key] = _flag(key, extra[key])
        return cls(**kw)

    @property
    def ring_bytes(self) -> int:
        """The staging ring of one worker in bytes."""
        return int(self.ring_mib * MIB)

    def host_blocks(self, block_bytes: int) -> int:
        """Host blocks of ``block_bytes`` (every TP rank's share of a KV block) the pool
        holds."""
        return self.host_bytes // block_bytes if block_bytes > 0 else 0

    def window_blocks(self, worker_block_bytes: int, world: int) -> int:
        """The writeback window of one worker in blocks (at least 1)."""
        if self.max_inflight_mib is not None:
            window = int(self.max_inflight_mib * MIB)
        else:
            window = default_window_bytes(self.ring_bytes, self.host_bytes // max(1, world))
        return max(1, window // worker_block_bytes) if worker_block_bytes > 0 else 1
