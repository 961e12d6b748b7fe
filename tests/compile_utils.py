"""CPU-only compile harness for CuTeDSL kernels targeting Hopper (sm_90a).

Everything here works on a machine with NO GPU and no CUDA driver: it traces a
``@cute.jit`` host function (which launches one or more ``@cute.kernel``),
lowers it through NVVM to PTX (and ptxas to a cubin) for ``sm_90a`` and hands
back the PTX text so tests can grep it for ``wgmma.mma_async``,
``cp.async.bulk.tensor``, ``st.global.v4`` ...

What we found in nvidia-cutlass-dsl 4.6.0 (``cutlass/base_dsl``):

* Arch selection.  ``BaseDSL.get_arch_enum()`` (used by every arch check, e.g.
  TMA / wgmma atom construction) and the NVVM target both use the compile
  option ``--gpu-arch`` when given, otherwise ``envar.arch``.  ``envar.arch``
  is ``CUTE_DSL_ARCH`` if set, else the arch of the local GPU, else
  **``sm_100``** (no GPU here!).  The env var is read ONCE, when the DSL
  singleton is created (first ``cute.compile`` / first jit call), so setting
  ``os.environ["CUTE_DSL_ARCH"]`` later has no effect.  This module therefore
  always passes ``--gpu-arch sm_90a`` explicitly; compile options are reset by
  the DSL after each compilation (``post_compilation_cleanup``), so the option
  never leaks into other compilations.
* Getting PTX.  ``compiled.__ptx__`` is ``None`` unless PTX is kept.  With
  ``--keep-ptx`` (or ``CUTE_DSL_KEEP=ptx``; ``CUTE_DSL_KEEP_PTX=1`` is
  deprecated) the DSL writes ``<dump-dir>/<mangled fn name>.<arch>.ptx`` and
  ``JitFunctionArtifacts`` reads that file back, so ``__ptx__`` becomes the
  PTX text.  CAVEAT: the dump directory must already exist -- if it does not,
  nothing is written and ``__ptx__`` silently holds the (non-existent) *path*.
  ``--dump-dir DIR`` overrides ``CUTE_DSL_DUMP_DIR`` (default: cwd).  Same
  scheme for ``--keep-cubin`` (``__cubin__`` -> bytes) and ``--keep-sass``
  (needs ``nvdisasm``).  We compile into a fresh temporary directory and
  read the artifacts back, so parallel compiles never collide.
* Fake tensors.  ``cute.runtime.make_fake_tensor(dtype, shape, stride,
  assumed_align=...)`` / ``make_fake_compact_tensor(dtype, shape,
  stride_order=...)`` describe tensor arguments without any memory; entries
  may be Python ints (static, baked into the kernel) or ``cute.sym_int32()`` /
  ``cute.sym_int64(divisibility=...)`` (dynamic, become runtime parameters).
  Reuse the same SymInt object where two modes must be equal.
  ``cute.runtime.make_fake_stream()`` stands in for a ``cuda.CUstream``
  argument.  ``from_dlpack`` on CPU torch tensors also works for tracing but
  bakes static shapes; prefer fake tensors.
* Cross compiling.  When the compile arch differs from the runtime arch
  (``envar.arch``, sm_100 on this GPU-less box) the DSL builds no JIT engine:
  the returned ``JitCompiledFunction`` cannot be *called*, only inspected
  (``__ptx__``, ``__cubin__``, ``__mlir__``) or exported.  On an H200 the
  detected arch is sm_90a, so the same object would be runnable there.
* TVM-FFI.  ``compile_options="--enable-tvm-ffi"`` also works on CPU; with
  ``make_fake_stream(use_tvm_ffi_env_stream=True)`` the stream argument
  disappears from the runtime signature and the kernel launches on
  ``torch.cuda.current_stream()`` (queried through torch's
  ``__dlpack_c_exchange_api__``, present in torch 2.11), so the compiled
  function is called with torch tensors directly.  Its wrapper checks
  device type, dtype, static extents, alignment and SymInt divisibility at
  every call (e.g. "Mismatched Tensor on argument #0 ... expected
  device_type=cuda").
* Other useful env vars: ``CUTE_DSL_LINEINFO=1``, ``CUTE_DSL_PRINT_IR=1``,
  ``CUTE_DSL_KEEP=ir,ptx,cubin,sass``, ``CUTE_DSL_COMPILER_OPT="warnings{nvvm}"``,
  ``CUTE_DSL_LOG_TO_CONSOLE=1``.  ``--ptxas-options '-v'`` passes flags to
  ptxas.
* Import caveat: never run python with ``cwd`` = the ``cutlass`` package
  directory (its ``torch.py`` shadows the real torch).

Usage::

    from compile_utils import compile_sm90a, fake_tensor, fake_stream
    art = compile_sm90a(my_host_fn, fake_tensor(torch.float16, (None, 128)), fake_stream())
    assert "cp.async.bulk.tensor" in art.ptx
"""

from __future__ import annotations

import re
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import (
    make_fake_compact_tensor,
    make_fake_stream,
    make_fake_tensor,
)

__all__ = [
    "HOPPER_ARCH",
    "CompiledArtifact",
    "compile_sm90a",
    "cute_dtype",
    "fake_tensor",
    "fake_stream",
    "sym",
]

HOPPER_ARCH = "sm_90a"

# The DSL keeps per-compilation state (compile options, kernel info) on a
# process-wide singleton: serialize compilations issued through this module.
_COMPILE_LOCK = threading.Lock()


@dataclass(frozen=True)
class CompiledArtifact:
    """Result of :func:`compile_sm90a`."""

    ptx: str
    compiled: Any  # cutlass JitCompiledFunction (callable only when arch == runtime arch)
    arch: str = HOPPER_ARCH
    cubin: Optional[bytes] = None

    def has(self, needle: str) -> bool:
        """True when ``needle`` (plain substring) occurs in the PTX."""
        return needle in self.ptx

    def count(self, pattern: str) -> int:
        """Number of regex matches of ``pattern`` in the PTX."""
        return len(re.findall(pattern, self.ptx))

    def instructions(self, prefix: str) -> set[str]:
        """Distinct full opcodes starting with ``prefix``, e.g.
        ``instructions("cp.async.bulk.tensor")``."""
        return set(re.findall(re.escape(prefix) + r"[\w.:]*", self.ptx))

    def kernel_names(self) -> list[str]:
        return re.findall(r"\.entry\s+(\w+)\s*\(", self.ptx)


def cute_dtype(dtype: Any) -> type:
    """Map a torch dtype (or a cutlass Numeric type) to the cutlass Numeric type."""
    if isinstance(dtype, type) and issubclass(dtype, cutlass.Numeric):
        return dtype
    import torch

    table = {
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
        torch.int8: cutlass.Int8,
        torch.uint8: cutlass.Uint8,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float8_e5m2: cutlass.Float8E5M2,
    }
    if dtype not in table:
        raise TypeError(f"no cutlass equivalent registered for dtype {dtype!r}")
    return table[dtype]


def sym(width: int = 32, divisibility: int = 1, symbol: Optional[str] = None):
    """A dynamic (runtime) extent/stride for fake tensors."""
    return cute.sym_int(width, divisibility=divisibility, symbol=symbol)


_Dim = Union[int, None, Any]  # int (static), None (fresh dynamic int32), SymInt


def fake_tensor(
    dtype: Any,
    shape: Sequence[_Dim],
    stride: Optional[Sequence[_Dim]] = None,
    assumed_align: int = 16,
):
    """A CPU-only fake tensor for ``cute.compile``.

    ``shape`` / ``stride`` entries: Python int -> static; ``None`` -> a fresh
    dynamic value (shape: int32; stride: int64 promised to be a multiple of
    16 bytes, so 16-byte vector accesses along the unit-stride mode stay
    legal); a ``SymInt`` (see :func:`sym`) is used as is.  With
    ``stride=None`` the tensor is compact row-major (last mode has stride 1,
    other strides are products of the inner extents, symbolic where an extent
    is symbolic).
    """
    dt = cute_dtype(dtype)
    shp = tuple(sym(32) if s is None else s for s in shape)
    elems_per_16b = max(1, 128 // dt.width)
    if stride is None:
        # compact row-major: mode 0 is the slowest, the last mode has stride 1
        order = tuple(range(len(shp) - 1, -1, -1))
        return make_fake_compact_tensor(
            dt, shp, stride_order=order, assumed_align=assumed_align
        )
    if len(stride) != len(shp):
        raise ValueError(f"stride rank {len(stride)} != shape rank {len(shp)}")
    strd = tuple(sym(64, divisibility=elems_per_16b) if s is None else s for s in stride)
    return make_fake_tensor(dt, shp, strd, assumed_align=assumed_align)


def fake_stream():
    """Fake CUDA stream argument for host functions taking a ``cuda.CUstream``."""
    return make_fake_stream()


def compile_sm90a(
    jit_fn: Any,
    *args: Any,
    gpu_arch: str = HOPPER_ARCH,
    compile_options: str = "",
    keep_cubin: bool = False,
    **kwargs: Any,
) -> CompiledArtifact:
    """Compile ``jit_fn`` (a ``@cute.jit`` host function) for ``gpu_arch`` and
    return its PTX.  Needs no GPU.

    ``args`` / ``kwargs`` are the representative arguments forwarded to
    ``cute.compile`` (fake tensors, fake stream, Python constants...).
    ``compile_options`` is appended to the option string (e.g.
    ``"--ptxas-options '-v'"`` or ``"--generate-line-info"``).
    """
    with tempfile.TemporaryDirectory(prefix="cute_sm90a_") as dump_dir:
        opts = f"--gpu-arch {gpu_arch} --keep-ptx --dump-dir {dump_dir}"
        if keep_cubin:
            opts += " --keep-cubin"
        if compile_options:
            opts += " " + compile_options
        with _COMPILE_LOCK:
            compiled = cute.compile(jit_fn, *args, options=opts, **kwargs)
        ptx = compiled.__ptx__
        cubin = compiled.__cubin__ if keep_cubin else None
    if not isinstance(ptx, str) or ".target" not in ptx:
        raise RuntimeError(
            f"CuTeDSL produced no PTX for {getattr(jit_fn, '__name__', jit_fn)!r} "
            f"(got {ptx!r:.200})"
        )
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    if target is None or target.group(1) != gpu_arch:
        raise RuntimeError(
            f"PTX targets {target.group(1) if target else '?'}, expected {gpu_arch}"
        )
    if keep_cubin and not isinstance(cubin, (bytes, bytearray)):
        raise RuntimeError("cubin requested but not produced")
    return CompiledArtifact(ptx=ptx, compiled=compiled, arch=gpu_arch, cubin=cubin)
