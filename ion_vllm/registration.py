"""Make ``--attention-backend ION`` mean "the ION backend" in every vLLM process.

vLLM 0.26 parses ``--attention-backend X`` with ``AttentionBackendEnum[X.upper()]``.  The
resulting enum member travels to the engine-core and GPU-worker processes inside the pickled
``VllmConfig``; an Enum member pickles *by value* and is unpickled before those processes
load their plugins.  A brand-new member added at runtime would therefore not exist yet on the
unpickling side, so ION does not add one.  Instead:

* the name ``ION`` is added as an *alias* of the built-in placeholder member
  ``AttentionBackendEnum.CUSTOM`` (an extra key in the Enum's ``_member_map_``; iteration over
  the enum is unchanged), so ``AttentionBackendEnum["ION"] is AttentionBackendEnum.CUSTOM``;
* ``CUSTOM`` is pointed at ``ion_vllm.backend.IonAttentionBackend`` with vLLM's own
  ``register_backend``.

``CUSTOM`` pickles as its value (``None``) and unpickles to ``CUSTOM`` in any process; the
``vllm.general_plugins`` entry point (``ion = ion_vllm:register``) runs :func:`register` in
each process before an attention backend is resolved, so ``--attention-backend CUSTOM`` works
as well.

:func:`register` is cheap: it imports only vLLM's registry module (no CUDA initialisation,
no cutlass / CuTe import) and is idempotent.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "ION"
BACKEND_QUALNAME = "ion_vllm.backend.IonAttentionBackend"


def install_enum_alias() -> None:
    """Add ``ION`` as a name of ``AttentionBackendEnum.CUSTOM`` (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member_map = AttentionBackendEnum._member_map_
    current = member_map.get(BACKEND_NAME)
    if current is AttentionBackendEnum.CUSTOM:
        return
    if current is not None:
        raise RuntimeError(
            f"AttentionBackendEnum already has a member named {BACKEND_NAME!r} "
            f"({current!r}); refusing to alias it to CUSTOM")
    member_map[BACKEND_NAME] = AttentionBackendEnum.CUSTOM


def register_backend_override() -> None:
    """Point ``AttentionBackendEnum.CUSTOM`` at the ION backend class (idempotent)."""
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    previous = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if previous is not None and previous != BACKEND_QUALNAME:
        logger.warning("AttentionBackendEnum.CUSTOM was registered to %s; "
                       "re-registering it to %s", previous, BACKEND_QUALNAME)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_QUALNAME)


#: the name of the handler in vLLM's default logging config (vllm/logger.py)
VLLM_HANDLER_NAME = "vllm"


def route_logs_to_vllm() -> None:
    """Give the ``ion_vllm`` loggers vLLM's handlers and level (idempotent).

    vLLM configures only its own ``vllm`` logger, so without this the backend's INFO lines
    (which kernel path it chose, and every logged fallback) would be dropped, and its
    warnings printed without vLLM's format.  Records still propagate to the root logger."""
    ion, vllm_logger = logging.getLogger("ion_vllm"), logging.getLogger("vllm")
    # only the handler vLLM's logging config creates (named "vllm"): other handlers found on
    # the vllm logger at that moment (a test harness's capture handlers, also on the root
    # logger) would see every ion_vllm record twice
    ours = [h for h in vllm_logger.handlers if h.get_name() == VLLM_HANDLER_NAME]
    for h in ours:
        if h not in ion.handlers:
            ion.addHandler(h)
    if ours and ion.level == logging.NOTSET:
        ion.setLevel(vllm_logger.level)


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``ION`` (and ``CUSTOM``) resolve to ION."""
    from ion_vllm.kv_tier import register_kv_tier

    route_logs_to_vllm()
    install_enum_alias()
    register_backend_override()
    register_kv_tier()  # the IonKVTier OffloadingSpec (idempotent, imports nothing heavy)


def is_registered() -> bool:
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    return (AttentionBackendEnum._member_map_.get(BACKEND_NAME)
            is AttentionBackendEnum.CUSTOM
            and _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == BACKEND_QUALNAME)
