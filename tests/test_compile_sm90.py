"""CPU-only sm_90a compile checks of every kernel the backend can launch (no GPU needed).

Each ``KernelOptions`` (``options.all_kernel_options()``) is compiled from fake tensors for
sm_90a, and its PTX and SASS must show the kernel's invariants: warpgroup MMAs, TMA loads
(and, with fused writeback, TMA stores), mbarrier pipelines with the documented arrival
counts, the producer/consumer register split of ``KernelOptions.registers``, the launch
bounds, and no local-memory spills.  The split-KV combine kernel of every
``KernelOptions.combine_key`` compiles too.  The compiles run in a process pool, one
compile per kernel, and the tests read the results.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile

import pytest

cutlass = pytest.importorskip("cutlass")

from cute_kernels.options import all_kernel_options  # noqa: E402

OPTIONS = all_kernel_options()
COMBINE_KEYS = sorted({o.combine_key for o in OPTIONS})


def _id(o) -> str:
    return f"{o.dtype}-d{o.head_dim}-gp{o.group_pad}-m{o.tile_m}" + ("-fused" if o.fresh_kv else "")


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia.cu13
    except ImportError:
        return None
    path = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "nvdisasm")
    return path if os.path.exists(path) else None


def _sass(cubin: bytes) -> str | None:
    tool = _nvdisasm()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def _compile_one(kind: str, key) -> tuple[str, str | None]:
    """(PTX, SASS) of one kernel; runs in a worker process."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cute_kernels import attention
    from compile_utils import compile_sm90a
    from cute_kernels.options import KernelOptions

    options = key if kind == "attention" else KernelOptions(*key)
    make = (attention.kernel_and_fake_args if kind == "attention"
            else attention.combine_kernel_and_fake_args)
    fn, args = make(options)
    art = compile_sm90a(fn, *args, compile_options="--enable-tvm-ffi", keep_cubin=True)
    return art.ptx, _sass(art.cubin)


@pytest.fixture(scope="module")
def compiled():
    """Every attention and combine kernel, compiled once for this module."""
    jobs = [("attention", o) for o in OPTIONS] + [("combine", k) for k in COMBINE_KEYS]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        futures = {job: pool.submit(_compile_one, *job) for job in jobs}
        return {job: f.result() for job, f in futures.items()}


def _barrier_init_counts(ptx: str) -> list[int]:
    """Arrival counts of every mbarrier.init (the count is a register set by a mov)."""
    movs = dict(re.findall(r"mov\.(?:b|u|s)32\s+(%r\d+),\s*(\d+);", ptx))
    counts = []
    for arg in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*([^;]+);",
                          ptx):
        arg = arg.strip()
        counts.append(int(arg) if arg.isdigit() else int(movs[arg]))
    return sorted(counts)


def _check_no_spills(ptx: str, sass: str | None) -> None:
    assert "st.local" not in ptx and "ld.local" not in ptx, "local memory in the PTX"
    if sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", sass), "ptxas spilled registers"


@pytest.mark.parametrize("options", OPTIONS, ids=_id)
def test_attention_kernel_compiles_for_sm90a(compiled, options):
    ptx, sass = compiled[("attention", options)]
    assert "\n.target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx, "QK^T and PV run on warpgroup MMAs"
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::c\w+\.global", ptx)
    # per consumer warpgroup a packed and an unpacked Q box, then K and V, one load site
    # per 64 columns of D each; with fused writeback also the fresh K and V tiles
    per_64 = 2 * options.consumers + 2 + (2 if options.fresh_kv else 0)
    assert len(loads) == per_64 * options.head_dim // 64
    stores = re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta", ptx)
    assert bool(stores) == options.fresh_kv, "fused writeback TMA-stores K/V, others store none"
    producer, consumer = options.registers
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{producer};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{consumer};" in ptx
    assert f".reqntid {options.threads}, 1, 1" in ptx
    assert f".minnctapersm {options.ctas_per_sm}" in ptx
    # full barriers count the one TMA thread, empty barriers one arrival a consumer warp
    n = options.q_stages + 2 * options.kv_stages
    assert _barrier_init_counts(ptx) == [1] * n + [4 * options.consumers] * n
    assert "griddepcontrol" not in ptx
    _check_no_spills(ptx, sass)
    if sass is not None:
        assert "HGMMA" in sass and "UTMALDG" in sass
        if options.fresh_kv:
            assert "UTMASTG" in sass
            # the straddle copy moves 16 bytes a lane: 128-bit shared loads, global stores
            assert re.search(r"\bLDS\.128\b", sass) and re.search(r"\bSTG\.E\.128\b", sass)


@pytest.mark.parametrize("key", COMBINE_KEYS, ids=lambda k: "-".join(map(str, k)))
def test_combine_kernel_compiles_for_sm90a(compiled, key):
    ptx, sass = compiled[("combine", key)]
    assert "ex2.approx" in ptx, "the merge weights are exp2 of log2-sum-exp differences"
    assert "shfl.sync" in ptx, "split weights travel by warp shuffle"
    _check_no_spills(ptx, sass)


def test_every_backend_kernel_is_compiled_here():
    """The options the vLLM builder precompiles are a subset of what this file compiles."""
    from cute_kernels.options import KernelOptions

    for fresh in (False, True):
        for tm in (64, 128, 192):
            o = KernelOptions.for_layer("bfloat16", 128, 28, 4, tm, fresh)
            assert o in OPTIONS
