"""Plain-PyTorch entry point of IonAttention: ``ion_attention(...)``.

Kernels are compiled once per variant (dtype, head_dim, group_pad, page) from fake tensors with
symbolic sizes (``--enable-tvm-ffi``), then called with torch tensors directly on the current
torch stream.  Compilation needs no GPU, so the same path compiles every variant for sm_90a on a
CPU machine (``compile_variant``); see tests/test_compile_sm90.py.

Fused KV writeback: ``ion_attention(..., key=, value=)`` runs the ``fresh_kv`` kernel variant
(``IonAttentionSm90(fresh_kv=True).fused``), which reads the step's new K/V from ``key`` /
``value`` and TMA-stores them into ``k_cache`` / ``v_cache`` inside the attention launch (no
``kv_append``).  It needs a plan made with ``fresh_kv=True`` (docs/contract.md).

Unpacked prefill tiles: a plan made with ``unpacked_prefill=True`` (``DevicePlan.unpacked``)
runs on the ``IonAttentionSm90(unpacked_prefill=True)`` variant, which also serves the
packed items of the same plan (work col 8 = -1); default plans keep the default kernel.

Two consumer warpgroups: a plan made with ``tile_m=128`` (``DevicePlan.tile_m``) runs on the
``IonAttentionSm90(consumers=2)`` variant (128-row q tiles, one 384-thread CTA per SM, both
consumer warpgroups share every K/V stage); ``tile_m=64`` plans keep the default kernels.

Page pairs (an experiment): a ``tile_m=128`` plan made with ``kv_pair=True``
(``DevicePlan.kv_pair``) runs on ``IonAttentionSm90(consumers=2, kv_pair=True)``, whose
K/V stages hold two 64-token pages (128-key S tiles); with ``key``/``value`` its fused
writeback form.

K/V pipeline depth: the 128-row kernels over 64-token pages run 4 K/V stages
(``kv_stages_for``); a ``tile_m=128`` plan made with ``kv_stages=2`` or ``3``
(``DevicePlan.kv_stages``) runs on ``IonAttentionSm90(consumers=2, kv_stages=n)`` instead
(2: the depth before 2026-12-02, for A/B runs; ``None``: the default).

Warpgroup ping-pong: a ``tile_m=128`` plan made with ``pingpong=True``
(``DevicePlan.pingpong``) runs on ``IonAttentionSm90(consumers=2, pingpong=True)``, whose
two consumer warpgroups issue their MMAs in turns (``check_pingpong``; ``None``: the
default, ``PINGPONG_DEFAULT``).

Pinned PV wait: a plan made with ``pin_pv_wait=True`` (``DevicePlan.pin_pv_wait``; any
tile size) runs on ``IonAttentionSm90(pin_pv_wait=True)``, whose steady state waits for
its previous O += P V after the softmax in the SASS too (``check_pin_pv_wait``; ``None``:
``PIN_PV_WAIT_DEFAULT``).
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from .planner import PACKED_WORK_COLS, WORK_COLS
from .variants import CTAS_PER_SM, PAGE_SIZE, Variant, variant_for

_compile_lock = threading.Lock()


def _cutlass_dtype(dtype):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]


def _work_cols(unpacked: bool) -> int:
    """Work-list width a kernel variant reads: 9 for unpacked_prefill variants, 8 for the
    packed-only ones (whose generated code then stays that of the 8-column contract)."""
    return WORK_COLS if unpacked else PACKED_WORK_COLS


def _fake_args(variant: Variant, unpacked: bool = False):
    """Fake tensors with symbolic sizes matching the kernel's runtime contract."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = _cutlass_dtype(variant.dtype)
    D, P = variant.head_dim, variant.page_size
    div = 8  # 16-byte alignment of every 16-bit stride, required by TMA

    def sym():
        return cute.sym_int()

    def sym_stride():
        return cute.sym_int64(divisibility=div)

    q = make_fake_tensor(dt, (sym(), sym(), D), stride=(sym_stride(), D, 1), assumed_align=16)
    o = make_fake_tensor(dt, (sym(), sym(), D), stride=(sym_stride(), D, 1), assumed_align=16)
    k = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(sym_stride(), sym_stride(), D, 1),
                         assumed_align=16)
    v = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(sym_stride(), sym_stride(), D, 1),
                         assumed_align=16)
    i32 = cutlass.Int32
    qsl = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    seq_lens = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    block_table = make_fake_tensor(i32, (sym(), sym()), stride=(cute.sym_int64(), 1), assumed_align=4)
    wc = _work_cols(unpacked)
    work = make_fake_tensor(i32, (sym(), wc), stride=(wc, 1), assumed_align=16)
    offsets = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    poff = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    po = make_fake_tensor(cutlass.Float32, (sym(), D), stride=(D, 1), assumed_align=16)
    plse = make_fake_tensor(cutlass.Float32, (sym(),), stride=(1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, o, qsl, seq_lens, block_table, work, offsets, poff, po, plse,
            cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1), stream)


def _check_consumers(consumers: int) -> int:
    if consumers not in (1, 2, 3):
        raise ValueError("consumers must be 1 (64-row q tiles), 2 (128-row) or 3 (192-row), "
                         f"got {consumers}")
    return int(consumers)


def consumers_for_tile_m(tile_m: int) -> int:
    """Kernel consumer warpgroups that run plans of ``tile_m`` MMA rows per q tile."""
    if tile_m not in (64, 128, 192):
        raise ValueError(f"tile_m must be 64, 128 or 192, got {tile_m}")
    return tile_m // 64


def ctas_per_sm_for(consumers: int, page_size: int = PAGE_SIZE) -> int:
    """Resident CTAs per SM of the persistent grid: 2 for the 256-thread (consumers=1)
    kernels, whatever the page size (see ``kv_stages_for``), 1 for the 384-thread
    consumers=2 kernels and the 512-thread consumers=3 kernels."""
    if _check_consumers(consumers) >= 2:
        return 1
    return CTAS_PER_SM


def kv_stages_for(consumers: int, page_size: int = PAGE_SIZE) -> int:
    """K/V pipeline stages of a kernel.  2, except 128-token pages on one consumer
    warpgroup: two stages of 128-row K and V tiles (128 KiB of shared memory) left room
    for one CTA per SM, and the H200 measured that losing the second CTA costs more than
    the wider tiles gain (mixed step +35%, prefill only -1.5%; bench/notes.md, v7).  With
    one stage a CTA needs 96 KiB (D = 128) and two CTAs fit.  The price: little prefetch
    inside a CTA.  Measured on the H200 with the producer order K_p, V_p, K_{p+1} (v8: the
    next K waited for the previous PV to free the V slot): mixed 166 us, prefill 818 us,
    against 155 and 804 for 64-token pages.  The producer now issues K_{p+1} before V_p on
    one stage (v9, measured on 2026-12-01: mixed 158 us, prefill 806 us against 152 and
    804 for 64-token pages; bench/notes.md).

    The 128-row kernels (consumers=2, one CTA per SM) over 64-token pages run 4 stages
    (since 2026-12-02): their shared memory holds it (4 x 32 KiB of K and V plus 64 KiB of
    Q buffers = 192 KiB of 227), and the H200 measured the attention-only 128-row kernel
    on one 8192-token prefill 0.5-1.6% faster at full clock and 4-7% faster in the slower
    phase a sustained run settles into, the fused-writeback form unchanged (+-0.2%),
    against 2 stages (bench/notes.md, v14); page pairs keep 2 stages of two pages."""
    c = _check_consumers(consumers)
    if c == 1 and page_size > PAGE_SIZE:
        return 1
    if c >= 2 and page_size == PAGE_SIZE:
        # consumers=3: 4 x 32 KiB of K and V plus six 64-row Q buffers (96 KiB) = 224 KiB
        # of the SM's 227 (the 192-row experiment, bench/notes.md v17)
        return 4
    return 2


#: K/V stage counts a ``tile_m=128`` plan may ask for (``kv_stages=``); 4 is the default
#: (``kv_stages_for``): 4 stages of 64-token K and V (128 KiB at D = 128) plus the four
#: 64-row Q buffers (64 KiB) fit one SM's 227 KiB of shared memory; 2 is the depth before
#: 2026-12-02, kept for A/B runs
DEEP_KV_STAGES = (2, 3, 4)


def check_kv_stages(kv_stages, consumers: int, page_size: int = PAGE_SIZE,
                    kv_pair: bool = False):
    """``kv_stages`` as a kernel will use it: ``None`` keeps ``kv_stages_for``; a number is
    accepted for the 128-row (consumers=2) kernels over 64-token pages without page pairs
    only, and must be one of ``DEEP_KV_STAGES`` (the default depth comes back as None)."""
    if kv_stages is None:
        return None
    n = int(kv_stages)
    if n not in DEEP_KV_STAGES:
        raise ValueError(f"kv_stages must be one of {DEEP_KV_STAGES}, got {kv_stages}")
    if _check_consumers(consumers) < 2 or page_size != PAGE_SIZE or kv_pair:
        raise ValueError("kv_stages is an option of the 128- and 192-row (tile_m=128, 192) "
                         f"kernels over {PAGE_SIZE}-token pages without kv_pair, got "
                         f"consumers={consumers}, page_size={page_size}, kv_pair={kv_pair}")
    # the default depth is the default kernel (one compiled kernel, not two)
    return None if n == kv_stages_for(consumers, page_size) else n


#: whether the 128-row (consumers=2) kernels run warpgroup ping-pong by default
#: (``IonAttentionSm90(pingpong=...)``: the two consumer warpgroups take turns issuing their
#: MMAs through two named barriers, as FA3 does).  Off: on the H200 (2026-12-02,
#: bench/notes.md v15) it is correct (GPU tests, 500/500 sweep) but one 8192-token prefill
#: ran 2.0-3.3% slower on the attention-only kernel and 4.3-5.2% slower fused.
PINGPONG_DEFAULT = False


def check_pingpong(pingpong, consumers: int):
    """``pingpong`` as a kernel will use it: ``None`` keeps ``PINGPONG_DEFAULT``; ``True`` is
    accepted on the 128-row (consumers=2) kernels only (it alternates their two consumer
    warpgroups); the default value, and False on a 64-row kernel, come back as None (one
    compiled kernel, not two)."""
    if pingpong is None:
        return None
    pp = bool(pingpong)
    if _check_consumers(consumers) != 2:
        if pp:
            raise ValueError("pingpong alternates the two consumer warpgroups of the 128-row "
                             f"(tile_m=128) kernels, got consumers={consumers}")
        return None
    return None if pp == PINGPONG_DEFAULT else pp


#: whether the attention kernels pin their steady-state PV wait after the softmax by
#: default (``IonAttentionSm90(pin_pv_wait=...)``; bench/notes.md, v16): off until measured
PIN_PV_WAIT_DEFAULT = False


def check_pin_pv_wait(pin_pv_wait):
    """``pin_pv_wait`` as a kernel will use it: ``None`` keeps ``PIN_PV_WAIT_DEFAULT``, and
    so does the default value (one compiled kernel, not two); the other value comes back."""
    if pin_pv_wait is None:
        return None
    pin = bool(pin_pv_wait)
    return None if pin == PIN_PV_WAIT_DEFAULT else pin


#: head sizes whose plans run the 16-byte straddle copy.  The D = 64 kernels compile it
#: spill-free too (a 48-register producer, twentieth session), and their GPU test forces it
#: by adding 64 here (tests/test_vec_straddle_gpu.py); 64 joins once that test and the
#: kernel bench have run on a Hopper GPU.  Other head sizes keep the element-wise copy.
VEC_STRADDLE_HEAD_DIMS = frozenset({128})
#: the fused kernels' straddle copy by default: the 16-byte one on every plan (head size
#: 128).  Until the nineteenth session it was "auto" (16-byte only on plans with a
#: straddling tile): the 16-byte kernels ran 1.5-2.5% slower where nothing straddles,
#: because ptxas placed the per-page mask test before the PV wgmma.  With the test decided
#: once an item (``planner.fresh_mask_units``) they were 0-4.5% faster than the
#: element-wise kernels on every prefill-carrying case of suites engine, anchors and chunks,
#: and within 1% of them on decode (bench/notes.md, nineteenth session).
VEC_STRADDLE_DEFAULT = True


def check_vec_straddle(vec_straddle, head_dim: int):
    """``vec_straddle`` as plans of head size ``head_dim`` will use it: ``"auto"``, True or
    False; False at head sizes outside ``VEC_STRADDLE_HEAD_DIMS`` (their plans keep the
    element-wise copy, so "auto" would compile one kernel twice)."""
    if isinstance(vec_straddle, str):
        if vec_straddle != "auto":
            raise ValueError(f"vec_straddle={vec_straddle!r}: use 'auto', True or False")
    else:
        vec_straddle = bool(vec_straddle)
    return vec_straddle if int(head_dim) in VEC_STRADDLE_HEAD_DIMS else False


def _or_default(checked, default: bool) -> bool:
    """The kernel's flag for a checked option (``check_pingpong``, ``check_pin_pv_wait``:
    None means the default)."""
    return default if checked is None else bool(checked)


def _multi_stages(variant: Variant, kv_pair: bool, consumers: int = 2) -> int:
    """Default K/V stages of a consumers=2 or 3 kernel: page pairs hold two pages per stage
    on 2 stages (the same shared memory as 4 single-page stages)."""
    return 2 if kv_pair else kv_stages_for(consumers, variant.page_size)


def make_kernel(variant: Variant, unpacked: bool = False, consumers: int = 1,
                lazy_rescale: bool = False, kv_pair: bool = False, kv_stages=None,
                pingpong=None, pin_pv_wait=None, skip_idle: bool = False):
    """The CuTeDSL kernel object of ``variant`` (compile it with ``fake_args(variant)``);
    ``unpacked``: the ``unpacked_prefill`` variant (same arguments); ``consumers=2``: the
    two-consumer-warpgroup variant running 128-row q tiles (plans with ``tile_m=128``);
    ``lazy_rescale``: the lazy-rescaling experiment (same arguments, same results);
    ``kv_pair``: two pages per K/V stage (``consumers=2`` only; same arguments);
    ``kv_stages``: K/V pipeline depth of a ``consumers=2`` kernel (``check_kv_stages``);
    ``pingpong``: warpgroup ping-pong of a ``consumers=2`` kernel (``check_pingpong``);
    ``pin_pv_wait``: the steady state's PV wait pinned after the softmax
    (``check_pin_pv_wait``); ``skip_idle``: a consumer warpgroup of a ``consumers >= 2``
    kernel whose rows hold no token of an item issues no wgmma for it (an experiment
    until GPU-tested; dropped at ``consumers=1``)."""
    from .attention_sm90 import IonAttentionSm90

    if kv_pair and _check_consumers(consumers) != 2:
        raise ValueError("kv_pair runs on the consumers=2 (tile_m=128) kernels only")
    stages = check_kv_stages(kv_stages, consumers, variant.page_size, kv_pair)
    pp = check_pingpong(pingpong, consumers)
    pin = _or_default(check_pin_pv_wait(pin_pv_wait), PIN_PV_WAIT_DEFAULT)
    c = _check_consumers(consumers)
    if c >= 2:
        return IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim,
                                variant.group_pad, variant.page_size, ctas_per_sm=1,
                                unpacked_prefill=unpacked, consumers=c,
                                lazy_rescale=lazy_rescale, kv_pair=kv_pair,
                                kv_stages=stages or _multi_stages(variant, kv_pair, c),
                                pingpong=_or_default(pp, PINGPONG_DEFAULT), pin_pv_wait=pin,
                                skip_idle=skip_idle)
    ctas = ctas_per_sm_for(1, variant.page_size)
    stages = kv_stages_for(1, variant.page_size)
    if unpacked:
        return IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim,
                                variant.group_pad, variant.page_size, ctas_per_sm=ctas,
                                unpacked_prefill=True, kv_stages=stages,
                                lazy_rescale=lazy_rescale, pin_pv_wait=pin)
    return IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim, variant.group_pad,
                            variant.page_size, ctas_per_sm=ctas, kv_stages=stages,
                            lazy_rescale=lazy_rescale, pin_pv_wait=pin)


def make_fused_kernel(variant: Variant, unpacked: bool = False, consumers: int = 1,
                      lazy_rescale: bool = False, kv_pair: bool = False, kv_stages=None,
                      pingpong=None, pin_pv_wait=None, vec_straddle: bool = False,
                      skip_idle: bool = False):
    """The fused-writeback (``fresh_kv``) entry point of ``variant``: a bound ``@cute.jit``
    method, compiled with ``fused_fake_args(variant)``; ``unpacked``: of the
    ``unpacked_prefill`` variant; ``consumers=2``: of the 128-row-tile variant;
    ``lazy_rescale``: of the lazy-rescaling experiment; ``kv_pair``: of the page-pair
    variant (``consumers=2`` only); ``kv_stages``, ``pingpong``, ``pin_pv_wait``: as for
    ``make_kernel``; ``vec_straddle``: the fresh-tile rows that reach into the next page
    are copied 16 bytes a lane instead of one element (an experiment until GPU-tested);
    ``skip_idle``: as for ``make_kernel``."""
    from .attention_sm90 import IonAttentionSm90

    if kv_pair and _check_consumers(consumers) != 2:
        raise ValueError("kv_pair runs on the consumers=2 (tile_m=128) kernels only")
    stages = check_kv_stages(kv_stages, consumers, variant.page_size, kv_pair)
    pp = check_pingpong(pingpong, consumers)
    pin = _or_default(check_pin_pv_wait(pin_pv_wait), PIN_PV_WAIT_DEFAULT)
    c = _check_consumers(consumers)
    if c >= 2:
        return IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim,
                                variant.group_pad, variant.page_size, ctas_per_sm=1,
                                fresh_kv=True, unpacked_prefill=unpacked, consumers=c,
                                lazy_rescale=lazy_rescale, kv_pair=kv_pair,
                                kv_stages=stages or _multi_stages(variant, kv_pair, c),
                                pingpong=_or_default(pp, PINGPONG_DEFAULT), pin_pv_wait=pin,
                                vec_straddle=vec_straddle, skip_idle=skip_idle).fused
    return IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim, variant.group_pad,
                            variant.page_size, ctas_per_sm=CTAS_PER_SM, fresh_kv=True,
                            unpacked_prefill=unpacked, lazy_rescale=lazy_rescale,
                            pin_pv_wait=pin, vec_straddle=vec_straddle).fused


def fused_fake_args(variant: Variant, unpacked: bool = False):
    """``fake_args`` of the fused kernel: q, key, value, k_cache, v_cache, out, ... where
    key/value are ``[T, Hkv, D]`` with any 16-byte-multiple token/head strides (views of
    the fused qkv projection are read in place)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    args = _fake_args(variant, unpacked)
    dt = _cutlass_dtype(variant.dtype)
    D = variant.head_dim

    def new_kv():
        return make_fake_tensor(dt, (cute.sym_int(), cute.sym_int(), D),
                                stride=(cute.sym_int64(divisibility=8),
                                        cute.sym_int64(divisibility=8), 1),
                                assumed_align=16)

    return (args[0], new_kv(), new_kv()) + tuple(args[1:])


def make_combine_kernel(variant: Variant, rows=False, pdl: bool = False):
    """The split-KV combine kernel; ``rows=True``: the row-parallel ``CombineRowsSm90``,
    ``rows="lanes"``: the split-parallel ``CombineLanesSm90`` (same arguments);
    ``pdl=True``: launched with programmatic dependent launch, waiting on the GPU for the
    attention grid before it (same arguments, same result)."""
    from .combine_sm90 import CombineLanesSm90, CombineRowsSm90, CombineSm90

    if rows not in (False, True, "lanes"):
        raise ValueError(f"combine kind {rows!r}: use False, True or 'lanes'")
    cls = CombineLanesSm90 if rows == "lanes" else CombineRowsSm90 if rows else CombineSm90
    return cls(_cutlass_dtype(variant.dtype), variant.head_dim, variant.group_pad, pdl=pdl)


def combine_fake_args(variant: Variant):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = _cutlass_dtype(variant.dtype)
    D = variant.head_dim
    sym = cute.sym_int
    o = make_fake_tensor(dt, (sym(), sym(), D), stride=(cute.sym_int64(divisibility=8), D, 1),
                         assumed_align=16)
    qsl = make_fake_tensor(cutlass.Int32, (sym(),), stride=(1,), assumed_align=4)
    comb = make_fake_tensor(cutlass.Int32, (sym(), 6), stride=(6, 1), assumed_align=4)
    po = make_fake_tensor(cutlass.Float32, (sym(), D), stride=(D, 1), assumed_align=16)
    plse = make_fake_tensor(cutlass.Float32, (sym(),), stride=(1,), assumed_align=4)
    return (o, qsl, comb, po, plse, cutlass.Int32(1), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


fake_args = _fake_args


@functools.lru_cache(maxsize=None)
def _compiled(variant: Variant, unpacked: bool = False, consumers: int = 1,
              lazy_rescale: bool = False, kv_pair: bool = False, kv_stages=None,
              pingpong=None, pin_pv_wait=None, skip_idle: bool = False):
    import cutlass.cute as cute

    with _compile_lock:
        return cute.compile(make_kernel(variant, unpacked, consumers, lazy_rescale, kv_pair,
                                        kv_stages, pingpong, pin_pv_wait, skip_idle),
                            *fake_args(variant, unpacked),
                            options="--enable-tvm-ffi")


@functools.lru_cache(maxsize=None)
def _compiled_fused(variant: Variant, unpacked: bool = False, consumers: int = 1,
                    lazy_rescale: bool = False, kv_pair: bool = False, kv_stages=None,
                    pingpong=None, pin_pv_wait=None, vec_straddle: bool = False,
                    skip_idle: bool = False):
    import cutlass.cute as cute

    with _compile_lock:
        return cute.compile(make_fused_kernel(variant, unpacked, consumers, lazy_rescale,
                                              kv_pair, kv_stages, pingpong, pin_pv_wait,
                                              vec_straddle, skip_idle),
                            *fused_fake_args(variant, unpacked), options="--enable-tvm-ffi")


@functools.lru_cache(maxsize=None)
def _compiled_combine(variant: Variant, rows=False, pdl: bool = False):
    import cutlass.cute as cute

    with _compile_lock:
        return cute.compile(make_combine_kernel(variant, rows, pdl), *combine_fake_args(variant),
                            options="--enable-tvm-ffi")


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class _PinnedStage:
    """Pinned host copy of the plan buffers and the event of its last upload."""

    def __init__(self, item_capacity: int, group_capacity: int, num_ctas: int, pin: bool,
                 work_cols: int = PACKED_WORK_COLS):
        self.work = torch.zeros((item_capacity, work_cols), dtype=torch.int32, pin_memory=pin)
        self.cta_offsets = torch.zeros(num_ctas + 1, dtype=torch.int32, pin_memory=pin)
        self.partial_offsets = torch.full((item_capacity,), -1, dtype=torch.int32, pin_memory=pin)
        self.combine = torch.zeros((group_capacity, 6), dtype=torch.int32, pin_memory=pin)
        self.num_items = 0
        self.num_groups = 0
        self.event = torch.cuda.Event() if pin else None
        self.recorded = False


class DevicePlan:
    """The planner's work list resident on the device, in buffers allocated once.

    ``upload(host_plan)`` writes a step's plan into the same device buffers (through two
    alternating pinned staging buffers, non-blocking), so launches captured in a CUDA graph
    stay valid on replay.  It also owns the split-KV workspace (``partial_o``/``partial_lse``)
    and the combine group list; plan with ``max_partial_rows=partial_rows_capacity``.
    ``always_combine`` makes every call launch the combine pass (needed under graph capture,
    where a later replay may carry split groups).
    """

    def __init__(self, *, item_capacity: int, group_capacity: int, partial_rows_capacity: int,
                 num_ctas: int, head_dim: int, device, always_combine: bool = False,
                 unpacked: bool = False, tile_m: int = 64, row_combine: bool = False,
                 page_size: int = PAGE_SIZE, lazy_rescale: bool = False,
                 pdl_combine: bool = False, lane_combine: bool = False,
                 kv_pair: bool = False, kv_stages=None, pingpong=None, pin_pv_wait=None,
                 vec_straddle=VEC_STRADDLE_DEFAULT, skip_idle: bool = False):
        device = torch.device(device)
        #: KV page size (tokens) the plans this holds count in: ion_attention refuses a
        #: cache of another page size (work items are page ranges)
        self.page_size = int(page_size)
        #: MMA rows of a q tile of the plans this holds: 64 runs the default kernels,
        #: 128 the consumers=2 variants (upload refuses a plan of the other kind)
        self.tile_m = int(tile_m)
        self.consumers = consumers_for_tile_m(self.tile_m)
        #: run the page-pair kernels (two 64-token pages per K/V stage; an experiment)
        self.kv_pair = bool(kv_pair)
        if self.kv_pair and (self.consumers != 2 or self.page_size != PAGE_SIZE):
            raise ValueError(f"kv_pair needs tile_m=128 plans over {PAGE_SIZE}-token pages, "
                             f"got tile_m={self.tile_m}, page_size={self.page_size}")
        #: K/V pipeline stages of the kernels that run these plans (None: the default;
        #: 2 or 3 on 128-row plans only, for A/B runs: see ``check_kv_stages``)
        self.kv_stages = check_kv_stages(kv_stages, self.consumers, self.page_size,
                                         self.kv_pair)
        #: warpgroup ping-pong of the 128-row kernels that run these plans (None: the
        #: default, ``PINGPONG_DEFAULT``; see ``check_pingpong``)
        self.pingpong = check_pingpong(pingpong, self.consumers)
        #: steady-state PV wait pinned after the softmax (None: the default,
        #: ``PIN_PV_WAIT_DEFAULT``; see ``check_pin_pv_wait``)
        self.pin_pv_wait = check_pin_pv_wait(pin_pv_wait)
        #: the straddle copy of the fused-writeback kernels: True (the default,
        #: ``VEC_STRADDLE_DEFAULT``) always runs the kernels whose copy moves 16-byte
        #: chunks (``IonAttentionSm90(vec_straddle=True)``), False the element-wise ones,
        #: ``"auto"`` the 16-byte ones for a plan with a straddling fresh tile
        #: (``Plan.straddles``) and the element-wise ones otherwise (the default of the
        #: eighteenth session).  Only at the head sizes of ``VEC_STRADDLE_HEAD_DIMS``
        #: (128); other head sizes never run them.
        self.vec_straddle_mode = check_vec_straddle(vec_straddle, head_dim)
        #: 128- and 192-row kernels whose idle consumer warpgroups issue no wgmma (an
        #: experiment: ``IonAttentionSm90(skip_idle=True)``; 64-row plans ignore it)
        self.skip_idle = bool(skip_idle)
        self.device = device
        self.num_ctas = int(num_ctas)
        self.item_capacity = max(1, int(item_capacity))
        self.group_capacity = max(1, int(group_capacity))
        self.partial_rows_capacity = int(partial_rows_capacity)
        self.always_combine = always_combine
        #: merge split-KV partials with the row-parallel combine kernel (CombineRowsSm90)
        self.row_combine = bool(row_combine)
        #: run the attention kernels' lazy-rescaling variants (an experiment; same results)
        self.lazy_rescale = bool(lazy_rescale)
        #: launch the combine with programmatic dependent launch (``CombineSm90(pdl=True)``):
        #: it is scheduled while the attention grid still runs and waits for it on the GPU
        self.pdl_combine = bool(pdl_combine)
        #: merge split-KV partials with the split-parallel combine (CombineLanesSm90: lane s
        #: loads split s, all of a row's loads in flight at once); takes precedence over
        #: row_combine
        self.lane_combine = bool(lane_combine)
        #: 8 columns for packed-only plans (the default kernels), 9 with unpacked_prefill
        self.work_cols = _work_cols(unpacked)
        self.work = torch.zeros((self.item_capacity, self.work_cols), dtype=torch.int32,
                                device=device)
        self.cta_offsets = torch.zeros(self.num_ctas + 1, dtype=torch.int32, device=device)
        self.partial_offsets = torch.full((self.item_capacity,), -1, dtype=torch.int32,
                                          device=device)
        self.combine = torch.zeros((self.group_capacity, 6), dtype=torch.int32, device=device)
        rows = max(1, self.partial_rows_capacity)
        self.partial_o = torch.empty((rows, head_dim), dtype=torch.float32, device=device)
        self.partial_lse = torch.empty((rows,), dtype=torch.float32, device=device)
        self.num_items = 0
        self.num_groups = 0
        self.host = None
        # work-list kind of the last uploaded plan: True = KV units for the fused-writeback
        # kernel (planner fresh_kv=True), False = cache pages, None = nothing uploaded yet
        self.fresh_kv = None
        # True: the last uploaded plan was made with unpacked_prefill=True (it may hold
        # unpacked items, work col 8 >= 0) and runs on the unpacked_prefill kernel variant
        self.unpacked = False
        pin = device.type == "cuda"
        self._stages = [_PinnedStage(self.item_capacity, self.group_capacity, self.num_ctas, pin,
                                     self.work_cols) for _ in range(2)]
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
        if getattr(host_plan, "unpacked", False) and self.work_cols != WORK_COLS:
            raise RuntimeError("an unpacked_prefill plan needs a DevicePlan(unpacked=True) "
                               "(9-column work list)")
        if getattr(host_plan, "tile_m", 64) != self.tile_m:
            raise RuntimeError(f"plan has tile_m={getattr(host_plan, 'tile_m', 64)}, this "
                               f"DevicePlan runs tile_m={self.tile_m} kernels")
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
        self.fresh_kv = bool(getattr(host_plan, "fresh_kv", False))
        self.unpacked = bool(getattr(host_plan, "unpacked", False))
        return self

    @property
    def vec_straddle(self) -> bool:
        """Whether the next fused launch of this plan runs the 16-byte straddle-copy
        kernels: ``vec_straddle_mode`` True, or "auto" and the uploaded plan straddles."""
        if self.vec_straddle_mode == "auto":
            return bool(getattr(self.host, "straddles", False))
        return self.vec_straddle_mode


def make_device_plan(query_start_loc_cpu, seq_lens_cpu, *, num_kv_heads: int, group_size: int,
                     page_size: int, head_dim: int, device, num_ctas: Optional[int] = None,
                     allow_split: bool = True, max_splits: int = 16,
                     fresh_kv: bool = False, unpacked_prefill: bool = False,
                     tile_m: int = 64, cost_model=None,
                     row_combine: bool = False, lazy_rescale: bool = False,
                     pdl_combine: bool = False, lane_combine: bool = False,
                     kv_pair: bool = False, kv_stages=None, pingpong=None,
                     pin_pv_wait=None, refine_balance: bool = True,
                     split_unpacked: bool = True, vec_straddle=VEC_STRADDLE_DEFAULT,
                     skip_idle: bool = False) -> DevicePlan:
    """Plan one batch on the host and place it on ``device`` (plain-PyTorch use; the vLLM
    backend keeps one DevicePlan per builder and calls ``upload`` every step).
    ``fresh_kv=True`` plans KV units for the fused-writeback call (``ion_attention(...,
    key=, value=)``); a plan is only valid for the kind of call it was made for.
    ``unpacked_prefill=True`` tiles long prefill rows of padded GQA groups (G < Gp) one q
    head x 64 tokens (planner ``unpacked_requests``); ``ion_attention`` then launches the
    unpacked_prefill kernel variant (``DevicePlan.unpacked``).
    ``tile_m=128``: 128-row q tiles for the two-consumer-warpgroup kernel
    (``IonAttentionSm90(consumers=2)``, one CTA per SM, so ``num_ctas`` defaults to the
    SM count); ``ion_attention`` picks that variant from ``DevicePlan.tile_m``.
    ``cost_model``: the planner's ``CostModel`` (default: the planner's own), e.g. one
    that makes splitting cheap so tests can force split-KV.
    ``row_combine=True``: split-KV partials are merged by the row-parallel combine kernel.
    ``lazy_rescale=True``: the attention kernels' lazy-rescaling variants run the plan
    (``IonAttentionSm90(lazy_rescale=True)``: an experiment, exact like the default).
    ``pdl_combine=True``: the combine pass is launched with programmatic dependent launch.
    ``lane_combine=True``: the split-parallel combine kernel (``CombineLanesSm90``).
    ``kv_pair=True`` (``tile_m=128`` only): the page-pair kernels run the plan.
    ``kv_stages=2`` or ``3`` (``tile_m=128`` only): kernels with that many K/V stages
    instead of the default 4.
    ``pingpong=True`` / ``False`` (``tile_m=128`` only): the kernels with / without
    warpgroup ping-pong (``None``: ``PINGPONG_DEFAULT``).
    ``pin_pv_wait=True`` / ``False``: the kernels with / without the pinned PV wait
    (``None``: ``PIN_PV_WAIT_DEFAULT``).
    ``refine_balance=False``: the planner without its final local search (``planner.plan``
    ``refine``), for A/B runs.
    ``split_unpacked=False``: unpacked items never split (planner ``split_unpacked``; the
    planner before v18), for A/B runs.
    ``vec_straddle``: True (the default, ``VEC_STRADDLE_DEFAULT``): a fused call runs the
    kernels whose straddle copy moves 16-byte chunks; False: the element-wise ones;
    ``"auto"``: the 16-byte ones when the plan has a straddling fresh tile (``DevicePlan``).
    ``skip_idle=True``: 128/192-row plans run the kernels whose idle consumer warpgroups
    issue no wgmma (an experiment: correct, and 20-30% slower on the H200)."""
    import numpy as np

    from .planner import plan as host_plan_fn

    if num_ctas is None:
        dev = torch.device(device)
        sms = num_sms(dev) if dev.type == "cuda" else 132
        num_ctas = sms * ctas_per_sm_for(consumers_for_tile_m(tile_m), page_size)
    p = host_plan_fn(np.asarray(query_start_loc_cpu, dtype=np.int32),
                     np.asarray(seq_lens_cpu, dtype=np.int32),
                     num_kv_heads=num_kv_heads, group_size=group_size, page_size=page_size,
                     num_ctas=num_ctas, allow_split=allow_split, max_splits=max_splits,
                     fresh_kv=fresh_kv, unpacked_prefill=unpacked_prefill,
                     tile_m=consumers_for_tile_m(tile_m) * 64, cost_model=cost_model,
                     refine=refine_balance, split_unpacked=split_unpacked)
    dp = DevicePlan(item_capacity=p.n_items, group_capacity=p.combine.shape[0],
                    partial_rows_capacity=p.partial_rows, num_ctas=num_ctas,
                    head_dim=head_dim, device=device, unpacked=unpacked_prefill,
                    tile_m=tile_m, row_combine=row_combine, page_size=page_size,
                    lazy_rescale=lazy_rescale, pdl_combine=pdl_combine,
                    lane_combine=lane_combine, kv_pair=kv_pair, kv_stages=kv_stages,
                    pingpong=pingpong, pin_pv_wait=pin_pv_wait, vec_straddle=vec_straddle,
                    skip_idle=skip_idle)
    return dp.upload(p)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def check_new_kv(q, key, value, k_cache):
    """Shape / dtype / layout checks of the step's new K/V for the fused-writeback call
    (device-independent, so they run on the CPU as well)."""
    if (key is None) != (value is None):
        raise ValueError("pass both key and value (fused KV writeback) or neither")
    if key is None:
        return
    want = (q.shape[0], k_cache.shape[1], k_cache.shape[3]) if k_cache.dim() == 4 else None
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or (want is not None and tuple(t.shape) != want):
            raise ValueError(f"{name} must be [T, Hkv, D] = {want} (T rows of q, the cache's "
                             f"Hkv and D), got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype must equal q dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            raise ValueError(f"{name} must have a contiguous, 16-byte aligned last dim")
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
            raise ValueError(f"{name} strides must be multiples of 16 bytes (TMA)")


def check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                 key=None, value=None):
    """Refuse, with a reason, every input the kernel does not implement (never a wrong
    answer or a fault inside the kernel)."""
    check_new_kv(q, key, value, k_cache)
    tensors = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table)
    if not all(t.is_cuda and t.device == q.device for t in tensors):
        raise ValueError("IonAttention needs every tensor on the same CUDA device")
    if not _is_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        raise RuntimeError("IonAttention needs an sm_90 (Hopper: H100/H200/GH200) GPU; "
                           f"{torch.cuda.get_device_name(q.device)} is not one")
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must be [T, Hq, D] of one shape, got {tuple(q.shape)} / {tuple(out.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or out.dtype != q.dtype:
        raise TypeError(f"q/out must be bf16 or fp16 of one dtype, got {q.dtype}/{out.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError("k_cache/v_cache dtype must equal q dtype")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, Hkv, page, D], got {tuple(k_cache.shape)}")
    T, Hq, D = q.shape
    _, Hkv, P, Dk = k_cache.shape
    if Dk != D or D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 and equal in q and cache, got {D}/{Dk}")
    if Hq % Hkv != 0 or Hq // Hkv > 8:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) with ratio <= 8")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            raise ValueError(f"{name} must have a contiguous, 16-byte aligned last dim")
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            raise ValueError(f"{name} strides must be multiples of 16 bytes (TMA)")
    if k_cache.stride(2) != D or v_cache.stride(2) != D:
        raise ValueError("cache pages must be contiguous [page, D] boxes (HND layout)")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")
    return T, Hq, Hkv, D, P


def combine_kind(plan):
    """The combine kernel a plan selects (``make_combine_kernel``'s ``rows``): "lanes" for
    ``lane_combine``, else ``row_combine`` (True: rows, False: the group combine)."""
    if getattr(plan, "lane_combine", False):
        return "lanes"
    return bool(getattr(plan, "row_combine", False))


def ion_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                  softmax_scale: float, plan: Optional[DevicePlan] = None, *,
                  query_start_loc_cpu=None, seq_lens_cpu=None, key=None, value=None,
                  experimental_pages: bool = False):
    """Causal paged attention over a mixed prefill/decode batch; writes ``out`` in place.

    ``plan`` is a DevicePlan built once per step; when None it is planned here from host
    copies of ``query_start_loc``/``seq_lens`` (pass them as ``*_cpu`` to avoid a sync).
    Launches the attention kernel, then (if any item is split) the combine pass.

    ``key``/``value`` (``[T, Hkv, D]``, rows aligned with ``q``): fused KV writeback.  The
    launch reads the new K/V from them and writes them into ``k_cache``/``v_cache`` at
    positions ``seq_len - q_len ..`` of each request through ``block_table`` (what
    ``kv_append`` with the block-table slot mapping would write), so no ``kv_append`` runs
    before it.  ``plan`` must then be a ``fresh_kv=True`` plan.  Cache slots of a request's
    last page past ``seq_len`` may receive garbage (docs/contract.md).

    ``experimental_pages=True`` admits the page sizes in ``variants.EXPERIMENTAL_PAGE_SIZES``
    (128 tokens: 128-row K/V tiles; its GPU tests pass, but it is slower than 64-token
    pages on the H200); not with key/value.
    """
    T, Hq, Hkv, D, P = check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens,
                                    block_table, key, value)
    G = Hq // Hkv
    fused = key is not None
    # refuse a bad page size before planning (the planner would plan it)
    variant = variant_for(q.dtype, D, G, P, experimental_pages=experimental_pages)
    if fused and P != PAGE_SIZE:
        raise ValueError(f"fused KV writeback needs {PAGE_SIZE}-token pages, got {P}")
    if plan is None:
        qsl_h = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.cpu()
        sl_h = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()
        plan = make_device_plan(qsl_h, sl_h, num_kv_heads=Hkv, group_size=G, page_size=P,
                                head_dim=D, device=q.device, fresh_kv=fused)
    plan_page = getattr(plan, "page_size", PAGE_SIZE)
    if plan_page != P:
        raise ValueError(f"plan counts {plan_page}-token pages, the cache has {P}-token pages")
    plan_fresh = getattr(plan, "fresh_kv", None)
    if plan_fresh is not None and plan_fresh != fused:
        raise ValueError("plan kind does not match the call: key/value given needs a "
                         "fresh_kv=True plan, a call without them a fresh_kv=False plan")
    if T == 0:
        return out
    # a plan made with unpacked_prefill=True may hold unpacked items (work col 8 >= 0):
    # only the unpacked_prefill variant reads col 8 (it runs packed items as the default)
    unpacked = bool(getattr(plan, "unpacked", False))
    # a tile_m=128 plan runs on the two-consumer-warpgroup variant (128-row q tiles)
    consumers = consumers_for_tile_m(getattr(plan, "tile_m", 64))
    lazy = bool(getattr(plan, "lazy_rescale", False))
    kv_pair = bool(getattr(plan, "kv_pair", False))
    stages = getattr(plan, "kv_stages", None)
    pp = getattr(plan, "pingpong", None)
    pin = getattr(plan, "pin_pv_wait", None)
    # skip_idle only exists on the consumers >= 2 kernels: keep one 64-row compile
    si = bool(getattr(plan, "skip_idle", False)) and consumers >= 2
    if fused:
        vs = bool(getattr(plan, "vec_straddle", False))
        _compiled_fused(variant, unpacked, consumers, lazy, kv_pair, stages, pp, pin, vs, si)(
                                 q, key, value, k_cache, v_cache, out, query_start_loc,
                                 seq_lens, block_table, plan.work, plan.cta_offsets,
                                 plan.partial_offsets, plan.partial_o, plan.partial_lse, G,
                                 softmax_scale * 1.4426950408889634, plan.num_ctas)
    else:
        _compiled(variant, unpacked, consumers, lazy, kv_pair, stages, pp, pin, si)(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                           plan.work, plan.cta_offsets, plan.partial_offsets, plan.partial_o,
                           plan.partial_lse, G, softmax_scale * 1.4426950408889634,
                           plan.num_ctas)
    if plan.always_combine or plan.num_groups > 0:
        _compiled_combine(variant, combine_kind(plan),
                          bool(getattr(plan, "pdl_combine", False)))(
            out, query_start_loc, plan.combine, plan.partial_o, plan.partial_lse, G,
            plan.num_ctas)
    return out


def precompile(dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
               page_size: int, slot_dtype=torch.int64, fused: bool = False,
               unpacked: bool = False, consumers=1, row_combine: bool = False,
               experimental_pages: bool = False, lazy_rescale: bool = False,
               pdl_combine: bool = False, lane_combine: bool = False,
               kv_pair: bool = False, kv_stages=None, pingpong=None,
               pin_pv_wait=None, vec_straddle=VEC_STRADDLE_DEFAULT,
               skip_idle: bool = False) -> None:
    """Compile (and load) every kernel one model config will launch: attention, combine and
    kv_append, plus the fused-writeback attention when ``fused``, and the unpacked_prefill
    attention variant(s) when ``unpacked`` (plans made with ``unpacked_prefill=True``).
    ``consumers``: 1, 2 or a collection of them: the attention kernels of 64-row
    (``tile_m=64`` plans) and / or 128-row (``tile_m=128``) q tiles.  ``row_combine``: the
    row-parallel combine kernel instead of the default one.  ``lazy_rescale``: the
    attention kernels' lazy-rescaling variants (plans with ``lazy_rescale=True``).
    ``pdl_combine``: the combine kernel launched with PDL (plans with ``pdl_combine=True``).
    ``lane_combine``: the split-parallel combine kernel (plans with ``lane_combine=True``).
    ``kv_pair``: the 128-row kernels' page-pair variants (plans with ``kv_pair=True``).
    ``kv_stages``: the 128-row kernels with that many K/V stages (plans with it).
    ``pingpong``: the 128-row kernels with / without warpgroup ping-pong (plans with it).
    ``pin_pv_wait``: the kernels with / without the pinned PV wait (plans with it).
    ``vec_straddle``: the fused kernels' 16-byte straddle copy: True (the default, as
    ``DevicePlan``) / False those kernels only, ``"auto"`` both (``check_vec_straddle``).
    ``skip_idle``: the 128/192-row kernels whose idle warpgroups skip wgmma (plans with it).
    Call it before CUDA-graph capture, so no compilation happens inside it."""
    from .append_sm90 import _compiled_kernel

    variant = variant_for(dtype, head_dim, num_q_heads // num_kv_heads, page_size,
                          experimental_pages=experimental_pages)
    kinds = (consumers,) if isinstance(consumers, int) else tuple(consumers)
    lz = bool(lazy_rescale)
    pin = check_pin_pv_wait(pin_pv_wait)
    vs_mode = check_vec_straddle(vec_straddle, head_dim)
    vs_kinds = (False, True) if vs_mode == "auto" else (vs_mode,)
    for c in sorted(set(_check_consumers(c) for c in kinds)):
        # with kv_pair every 128-row plan runs the page-pair kernels, so only those
        pair = bool(kv_pair) and c == 2
        stages = check_kv_stages(kv_stages, c, page_size, pair) if c == 2 else None
        pp = check_pingpong(pingpong, c) if c == 2 else None
        for u in (False, True) if unpacked else (False,):
            si = bool(skip_idle) and c >= 2
            _compiled(variant, u, c, lz, pair, stages, pp, pin, si)
            if fused:
                for vs in vs_kinds:
                    _compiled_fused(variant, u, c, lz, pair, stages, pp, pin, vs, si)
    _compiled_combine(variant, "lanes" if lane_combine else bool(row_combine), pdl_combine)
    _compiled_kernel(dtype, head_dim, num_kv_heads, page_size, slot_dtype)
