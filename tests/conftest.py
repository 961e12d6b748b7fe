"""Test-wide setup.

* ``gpu`` tests run only where an sm_90 (Hopper) GPU is present.
* Scratch files stay inside the checkout (``.pytest_tmp/<pid>``, removed at the end): the
  suite leaves nothing in ``/tmp``.  CuTeDSL's file cache is off, so compile tests compile;
  ION's kernel cache lives in the scratch too.
* ``seed``: a fresh seed per session, printed in the report header and used by every
  randomized test; ``PYTEST_SEED=<n>`` replays a session.
"""

import os
import shutil
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCRATCH = os.path.join(ROOT, ".pytest_tmp", str(os.getpid()))
os.makedirs(SCRATCH, exist_ok=True)
os.environ["TMPDIR"] = SCRATCH
tempfile.tempdir = SCRATCH
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
os.environ.setdefault("CUTE_DSL_CACHE_DIR", os.path.join(SCRATCH, "cute"))
os.environ.setdefault("ION_KERNEL_CACHE", os.path.join(SCRATCH, "kernels"))

SESSION_SEED = int(os.environ.get("PYTEST_SEED") or time.time_ns() % (1 << 31))


def pytest_report_header(config):
    return f"seed: {SESSION_SEED} (replay with PYTEST_SEED={SESSION_SEED})"


def pytest_terminal_summary(terminalreporter):
    # -q hides the header: the seed is repeated at the end, so every log records it
    terminalreporter.write_line(f"seed: {SESSION_SEED} (replay with PYTEST_SEED={SESSION_SEED})")


@pytest.fixture
def seed(request) -> int:
    """The session seed mixed with the test's id: fresh every session, replayable, and
    different for each parametrized case."""
    import zlib

    return (SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SCRATCH, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(SCRATCH))  # the last session out removes the parent
    except OSError:
        pass


def _hopper_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(0) == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def force_cpu_platform(mp) -> object:
    """Make vLLM resolve `current_platform` to CpuPlatform (also in modules that already
    bound the name at import time), as vLLM's own `bench` CLI does on a GPU-less host.
    ``mp`` is a pytest MonkeyPatch; undoing it restores the platform."""
    mp.setenv("HF_HUB_OFFLINE", "1")
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    mp.setattr(vllm.platforms, "_current_platform", platform)
    for name, module in list(sys.modules.items()):
        if (name.startswith("vllm") and module is not None
                and "current_platform" in getattr(module, "__dict__", {})):
            mp.setattr(module, "current_platform", platform)
    return platform


@pytest.fixture
def cpu_platform(monkeypatch):
    return force_cpu_platform(monkeypatch)


@pytest.fixture(scope="module")
def cpu_platform_module():
    mp = pytest.MonkeyPatch()
    yield force_cpu_platform(mp)
    mp.undo()
