"""The set of IonAttention kernel variants the backend can select.

A variant is fixed at compile time by (dtype, head_dim, group_pad, page_size); everything else
(token count, head counts, GQA ratio G <= group_pad, number of pages, batch) is a runtime value.
"""

from __future__ import annotations

from typing import NamedTuple

SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_GROUP_PADS = (1, 2, 4, 8)
PAGE_SIZE = 64
#: page sizes the kernel compiles and passes its GPU tests for, but that measured slower than
#: 64-token pages on the H200 (an experiment, bench/notes.md v7-v9); only
#: ``variant_for(..., experimental_pages=True)`` (``ion_attention(experimental_pages=True)``)
#: accepts them.  128-token pages give 128-row K/V tiles (one TMA box per stage, QK^T as
#: m64n128k16 wgmma): the kernel-level experiment behind bench backend ``ion-auto-p128``.
EXPERIMENTAL_PAGE_SIZES = (128,)
MAX_GROUP = 8
# resident CTAs per SM of the persistent grid (registers and smem are sized for two)
CTAS_PER_SM = 2


class Variant(NamedTuple):
    dtype: str        # "bfloat16" | "float16"
    head_dim: int     # 64 | 128
    group_pad: int    # 1 | 2 | 4 | 8  (GQA ratio rounded up to a power of two)
    page_size: int    # KV page = KV tile = one TMA box


def group_pad_for(group_size: int) -> int:
    if not 1 <= group_size <= MAX_GROUP:
        raise ValueError(f"GQA ratio must be in 1..{MAX_GROUP}, got {group_size}")
    gp = 1
    while gp < group_size:
        gp *= 2
    return gp


def variant_for(torch_dtype, head_dim: int, group_size: int, page_size: int = PAGE_SIZE,
                experimental_pages: bool = False) -> Variant:
    name = str(torch_dtype).replace("torch.", "")
    if name not in SUPPORTED_DTYPES:
        raise TypeError(f"IonAttention supports {SUPPORTED_DTYPES}, got {name}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"IonAttention supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if page_size in EXPERIMENTAL_PAGE_SIZES:
        if not experimental_pages:
            raise ValueError(
                f"IonAttention pages of {page_size} tokens are experimental (slower than "
                f"{PAGE_SIZE}-token pages on the H200): pass experimental_pages=True, or use "
                f"{PAGE_SIZE}-token pages")
    elif page_size != PAGE_SIZE:
        raise ValueError(f"IonAttention pages hold {PAGE_SIZE} tokens, got {page_size}")
    return Variant(name, head_dim, group_pad_for(group_size), page_size)


ALL_VARIANTS = tuple(
    Variant(dt, d, gp, PAGE_SIZE)
    for dt in SUPPORTED_DTYPES
    for d in SUPPORTED_HEAD_DIMS
    for gp in SUPPORTED_GROUP_PADS
)
