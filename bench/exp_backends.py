"""``ion-bench kernel --register`` file: another checkout's kernels (same API as this one)
beside this checkout's, for an experiment's A/B in one process.

Registers ``exp-ion`` (the layer) and ``exp-ion-attn`` (attention alone) for the
``cute_kernels`` in ``$EXP_TREE`` (``git archive BRANCH cute_kernels | tar -x -C DIR``),
planned as this checkout plans (``make_device_plan``, ``tile_m="auto"``).
"""

import importlib
import os
from types import SimpleNamespace

from ion_vllm.bench import kernel_runner as kr

kr.import_package(os.path.join(os.environ["EXP_TREE"], "cute_kernels"), "cute_kernels_exp")
_attention = importlib.import_module("cute_kernels_exp.attention")
exp = SimpleNamespace(
    ion_attention=_attention.ion_attention, sink_log2=_attention.sink_log2,
    make_device_plan=importlib.import_module("cute_kernels_exp.device_plan").make_device_plan,
    kv_append=importlib.import_module("cute_kernels_exp.append_sm90").kv_append)

kr.BACKENDS["exp-ion"] = kr.ion_backend("fused", kernels=exp)
kr.BACKENDS["exp-ion-attn"] = kr.ion_backend("attn", kernels=exp)
