"""A persistent cache of compiled kernels, so that a process start compiles nothing.

A compiled kernel (host launcher + cubin, TVM-FFI entry point) is exported to an object file
once and loaded from it in later processes with ``cute.runtime.load_module``: no tracing, no
compiler.  The file name hashes everything the binary depends on: the kernel's key, the
kernel sources of this package, the CuTeDSL version and the target arch, so a code change
never loads a stale kernel.

Where: ``$ION_KERNEL_CACHE`` if set (``off`` disables the cache), else
``~/.cache/ion-vllm/kernels``.  Writes are atomic (a temporary file renamed into place), so
processes starting together (tensor-parallel workers) may race on one kernel safely.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "ION_KERNEL_CACHE"
ARCH = "sm_90a"


def cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "ion-vllm" / "kernels"


@functools.lru_cache(maxsize=None)
def _code_hash() -> str:
    """Hash of this package's kernel sources and of the CuTeDSL release."""
    h = hashlib.sha256()
    try:
        h.update(importlib.metadata.version("nvidia-cutlass-dsl").encode())
    except importlib.metadata.PackageNotFoundError:
        import cutlass

        h.update(str(getattr(cutlass, "__version__", "unknown")).encode())
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def entry_name(key) -> str:
    """A C symbol prefix unique to ``key`` and to this code: the cached object's file stem."""
    digest = hashlib.sha256(f"{ARCH}|{_code_hash()}|{key!r}".encode()).hexdigest()[:24]
    return f"ion_{digest}"


def load(key):
    """The cached kernel of ``key``, or None (no cache, a miss, or an unusable file)."""
    root = cache_dir()
    if root is None:
        return None
    name = entry_name(key)
    path = root / f"{name}.o"
    if not path.exists():
        return None
    try:
        from cutlass.cute.runtime import load_module

        return getattr(load_module(str(path), enable_tvm_ffi=True), name)
    except Exception as e:  # noqa: BLE001 - a broken file is a miss, compiled again
        logger.warning("ION: cached kernel %s unusable (%s); compiling it", path, e)
        return None


def store(key, compiled) -> None:
    """Export ``compiled`` (a ``cute.compile`` result with TVM-FFI) for later processes."""
    root = cache_dir()
    if root is None:
        return
    name = entry_name(key)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".o", prefix=f".{name}-", dir=root)
        os.close(fd)
        try:
            compiled.export_to_c(tmp, name)
            os.replace(tmp, root / f"{name}.o")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        logger.warning("ION: could not cache kernel %s in %s (%s)", key, root, e)


def load_or_compile(key, compile_fn):
    """The kernel of ``key`` from the cache, else ``compile_fn()`` stored for next time."""
    fn = load(key)
    if fn is None:
        fn = compile_fn()
        store(key, fn)
    return fn
