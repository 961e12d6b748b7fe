"""``ion-bench kernel --register`` file: the tag's default kernels beside this checkout's.

Registers ``tag-ion`` (the layer: fused writeback) and ``tag-ion-attn`` (attention alone)
for the checkout in ``$TAG_TREE`` (``git archive lab-2026-12 cute_kernels``, unpacked
there), planned with the defaults the tag's vLLM backend ran: unpacked prefill tiles,
64/128/192-row tiles per step, the split-parallel combine, the 16-byte straddle copy
(head size 128; the tag's D = 64 kernels copy element-wise).
"""

import importlib
import os
from types import SimpleNamespace

import numpy as np

from ion_vllm.bench import kernel_runner as kr

kr.import_package(os.path.join(os.environ["TAG_TREE"], "cute_kernels"), "cute_kernels_tag")
# the tag's package __init__ resolves its exports by absolute name (this checkout's
# cute_kernels): take them from its submodules instead
_attention = importlib.import_module("cute_kernels_tag.attention")
tag = SimpleNamespace(ion_attention=_attention.ion_attention,
                      make_device_plan=_attention.make_device_plan,
                      kv_append=importlib.import_module("cute_kernels_tag.append_sm90").kv_append)


def tag_plan(kernels, case, device, fresh_kv):
    from cute_kernels_tag.planner import choose_tile_m

    qsl = np.asarray(case.query_start_loc(), dtype=np.int32)
    sl = np.asarray(case.kv_lens, dtype=np.int32)
    tile_m = choose_tile_m(qsl, sl, num_q_heads=case.hq, num_kv_heads=case.hkv,
                           head_dim=case.d, allow_192=True)
    return kernels.make_device_plan(qsl, sl, num_kv_heads=case.hkv,
                                    group_size=case.hq // case.hkv, page_size=64,
                                    head_dim=case.d, device=device, fresh_kv=fresh_kv,
                                    unpacked_prefill=True, tile_m=tile_m, row_combine=True,
                                    lane_combine=True)


kr.BACKENDS["tag-ion"] = kr.ion_backend("fused", kernels=tag, plan=tag_plan)
kr.BACKENDS["tag-ion-attn"] = kr.ion_backend("attn", kernels=tag, plan=tag_plan)
