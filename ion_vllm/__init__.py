"""ion-vllm: the ION attention backend (IonAttention, a CuTeDSL Hopper kernel) for vLLM.

``register`` is the ``vllm.general_plugins`` entry point; it makes
``vllm serve MODEL --attention-backend ION`` select :class:`ion_vllm.backend.IonAttentionBackend`.
Importing this package is cheap: no torch CUDA initialisation, no cutlass / CuTe import.
"""

from ion_vllm.registration import BACKEND_NAME, BACKEND_QUALNAME, register

__all__ = ["BACKEND_NAME", "BACKEND_QUALNAME", "register"]
__version__ = "0.1.0"
