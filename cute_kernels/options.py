"""The compile-time options of one IonAttention kernel, and what follows from them.

``KernelOptions`` is the whole compile-cache key: two calls with equal options run the same
compiled kernel, and ``precompile`` enumerates nothing else.  Token counts, head counts, the
GQA ratio ``G <= group_pad``, pages and batch size are runtime values.
"""

from __future__ import annotations

from dataclasses import dataclass

#: tokens of one KV page = one K or V TMA box = one KV tile of the main loop
PAGE_SIZE = 64
SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_GROUP_PADS = (1, 2, 4, 8, 16)
#: q-tile rows: 64 per consumer warpgroup (one, two or three of them)
SUPPORTED_TILE_M = (64, 128, 192)
#: head sizes whose K/V stages are too large for two CTAs an SM or a third consumer: one
#: 64-row page of K or V is 32 KiB at D = 256, and a consumer's O accumulator 128 registers
WIDE_HEAD_DIM = 256
MAX_GROUP = 16
#: MMA rows of one consumer warpgroup's q tile (the wgmma M dimension)
WARPGROUP_ROWS = 64


def group_pad_for(group_size: int) -> int:
    """The GQA ratio rounded up to a power of two (the q heads of one packed tile)."""
    if not 1 <= group_size <= MAX_GROUP:
        raise ValueError(f"IonAttention supports GQA ratios 1..{MAX_GROUP}, got {group_size}")
    return 1 << (int(group_size) - 1).bit_length()


def tile_ms_for(head_dim: int) -> tuple[int, ...]:
    """The q-tile rows kernels of this head size run: 192 rows (three consumers of 144
    registers) cannot hold a D = 256 accumulator."""
    return SUPPORTED_TILE_M if head_dim < WIDE_HEAD_DIM else (64, 128)


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` -> ``"bfloat16"``, refusing other dtypes."""
    name = str(dtype).replace("torch.", "")
    if name not in SUPPORTED_DTYPES:
        raise TypeError(f"IonAttention supports {SUPPORTED_DTYPES}, got {name}")
    return name


@dataclass(frozen=True)
class KernelOptions:
    """One attention kernel: data type, head size, padded GQA group, q-tile rows, and
    whether the launch also writes the step's new K/V into the cache (fused writeback)."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    group_pad: int = 8
    tile_m: int = 64
    fresh_kv: bool = False

    def __post_init__(self):
        dtype_name(self.dtype)
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"IonAttention supports head sizes {SUPPORTED_HEAD_DIMS}, "
                             f"got {self.head_dim}")
        if self.group_pad not in SUPPORTED_GROUP_PADS:
            raise ValueError(f"group_pad must be one of {SUPPORTED_GROUP_PADS}, "
                             f"got {self.group_pad}")
        if self.tile_m not in tile_ms_for(self.head_dim):
            raise ValueError(f"tile_m must be one of {tile_ms_for(self.head_dim)} at head "
                             f"size {self.head_dim}, got {self.tile_m}")

    @classmethod
    def for_layer(cls, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                  tile_m: int = 64, fresh_kv: bool = False) -> "KernelOptions":
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        return cls(dtype_name(dtype), int(head_dim),
                   group_pad_for(num_q_heads // num_kv_heads), int(tile_m), bool(fresh_kv))

    # ---- derived launch shape ----------------------------------------------------------
    @property
    def consumers(self) -> int:
        """Consumer warpgroups: each computes 64 rows of the q tile."""
        return self.tile_m // WARPGROUP_ROWS

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def wide(self) -> bool:
        return self.head_dim >= WIDE_HEAD_DIM

    @property
    def ctas_per_sm(self) -> int:
        """Two 256-thread CTAs share an SM (one's softmax hides under the other's MMAs);
        the 384- and 512-thread CTAs, and every D = 256 CTA (192 KiB of shared memory),
        run alone."""
        return 2 if self.consumers == 1 and not self.wide else 1

    @property
    def kv_stages(self) -> int:
        """K/V pipeline depth: 2 at two CTAs per SM; 4 for one CTA per SM (4 x 32 KiB of K
        and V plus the Q buffers fit the 227 KiB of shared memory at D = 128); 2 at D = 256
        (2 x 64 KiB of K and V a stage, still 128 KiB in flight an SM)."""
        return 2 if self.consumers == 1 or self.wide else 4

    @property
    def q_stages(self) -> int:
        """Q buffers a consumer: 2 (the next item's Q loads during this one), 1 for the
        128-row D = 256 tile (2 x 32 KiB of Q beside 128 KiB of K/V)."""
        return 1 if self.wide and self.consumers > 1 else 2

    @property
    def smem_bytes(self) -> int:
        """Shared memory of the Q, K and V buffers (the mbarriers add under 1 KiB)."""
        box = WARPGROUP_ROWS * self.head_dim * 2
        return box * (self.q_stages * self.consumers + 2 * self.kv_stages)

    @property
    def registers(self) -> tuple[int, int]:
        """(producer, consumer) registers a thread after ``setmaxnreg``.

        Two CTAs of 256 threads: 128 x 24 + 128 x 232 = 32768 each.  The fused producer
        keeps an item's unit and ownership state live and spills below 40; at D = 64 its
        16-byte straddle copy spills below 48.  384 threads: 128 x 24 + 256 x 240 fits
        the 64K file.  512 threads: consumers hold 144, under which ptxas keeps the
        steady state's exp2s un-rematerialized at D = 128 (more ran 15% slower)."""
        # the straddle copy of D = 64 and D = 256 rows spills the fused producer below 48
        wide_copy = self.fresh_kv and self.head_dim in (64, 256)
        producer = 48 if wide_copy else 40 if self.fresh_kv else 24
        if self.wide and self.consumers == 1:
            # one CTA an SM: the consumer takes 240 (O alone holds 128)
            return producer, 240
        if self.consumers == 3:
            return producer, 144
        if self.consumers == 2:
            return producer, 224 if wide_copy else 232 if self.fresh_kv else 240
        return producer, 208 if wide_copy else 216 if self.fresh_kv else 232

    @property
    def combine_key(self) -> tuple[str, int, int]:
        """The split-KV combine kernel depends on these only."""
        return self.dtype, self.head_dim, self.group_pad


def all_kernel_options() -> tuple[KernelOptions, ...]:
    """Every kernel the backend can launch (CI compiles each one for sm_90a)."""
    return tuple(KernelOptions(dt, d, gp, tm, fr)
                 for dt in SUPPORTED_DTYPES for d in SUPPORTED_HEAD_DIMS
                 for gp in SUPPORTED_GROUP_PADS for tm in tile_ms_for(d)
                 for fr in (False, True))
