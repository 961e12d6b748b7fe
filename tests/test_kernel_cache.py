"""The persistent kernel cache (cute_kernels/kernel_cache.py) on the CPU: a kernel
cross-compiled for sm_90a is exported, then loaded by a fresh lookup without compiling;
keys separate kernels and code versions; a broken file is a miss; ``off`` disables it."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

from cute_kernels import kernel_cache  # noqa: E402
from cute_kernels.options import KernelOptions  # noqa: E402


def _compile_combine():
    import cutlass.cute as cute

    from cute_kernels.attention import combine_kernel_and_fake_args

    kernel, args = combine_kernel_and_fake_args(KernelOptions("bfloat16", 64, 2))
    return cute.compile(kernel, *args, options="--enable-tvm-ffi --gpu-arch sm_90a")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_round_trip_loads_without_compiling(cache):
    key = ("combine", ("bfloat16", 64, 2))
    calls = []

    def compile_once():
        calls.append(1)
        return _compile_combine()

    first = kernel_cache.load_or_compile(key, compile_once)
    files = list(cache.iterdir())
    assert [f.name for f in files] == [kernel_cache.entry_name(key) + ".o"]
    again = kernel_cache.load_or_compile(key, compile_once)
    assert calls == [1], "the second lookup compiled again"
    assert type(again).__name__ == "Function", "not the exported TVM-FFI entry point"
    assert first is not again


def test_keys_and_code_versions_name_different_files(monkeypatch):
    a = kernel_cache.entry_name(("attention", KernelOptions(tile_m=64)))
    b = kernel_cache.entry_name(("attention", KernelOptions(tile_m=128)))
    assert a != b and a.startswith("ion_") and a.isidentifier()
    monkeypatch.setattr(kernel_cache, "_code_hash", lambda: "another version")
    assert kernel_cache.entry_name(("attention", KernelOptions(tile_m=64))) != a


def test_broken_file_is_a_miss(cache, caplog):
    key = ("combine", ("bfloat16", 64, 2))
    (cache / (kernel_cache.entry_name(key) + ".o")).write_bytes(b"not an object file")
    assert kernel_cache.load(key) is None
    assert "unusable" in caplog.text


def test_off_disables_the_cache(monkeypatch):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, "off")
    assert kernel_cache.cache_dir() is None
    assert kernel_cache.load(("combine", ())) is None
    kernel_cache.store(("combine", ()), object())  # nothing to write, nothing raised
