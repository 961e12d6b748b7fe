"""ion_vllm/kv_tier's modules import each other without a cycle (the lab's page_gather <->
raw_issue cycle is gone), each imports on its own in a fresh interpreter, and the package
names no ``ION_*`` environment variable but ION_KV_TIER_GB."""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ion_vllm", "kv_tier")
MODULES = sorted(f[:-3] for f in os.listdir(PKG) if f.endswith(".py"))


def _deps(mod: str) -> set[str]:
    """The package modules ``mod`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(PKG, f"{mod}.py")).read())):
        if isinstance(node, ast.ImportFrom) and node.module == "ion_vllm.kv_tier":
            names = {a.name for a in node.names}
            out |= (names & set(MODULES)) or {"__init__"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "ion_vllm.kv_tier."):
            out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names
                    if a.name.startswith("ion_vllm.kv_tier.")}
    return out - {mod}


def test_no_import_cycle_inside_the_package():
    graph = {m: _deps(m) for m in MODULES}
    done: set[str] = set()

    def visit(m, path):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        for d in graph.get(m, ()):
            visit(d, path + [m])
        done.add(m)

    for m in MODULES:
        visit(m, [])
    assert "raw_issue" not in MODULES and "testing" not in MODULES


def test_each_module_imports_on_its_own():
    """In a fresh interpreter, each module imported with no other module of the package
    loaded (torch and vLLM stay loaded between them: only the package is isolated)."""
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('ion_vllm')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module('ion_vllm.kv_tier' + ('' if m == '__init__' else '.' + m))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=600, text=True,
                       capture_output=True, check=False, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_only_environment_variable_is_ion_kv_tier_gb():
    found = set()
    for m in MODULES:
        found |= set(re.findall(r"ION_[A-Z0-9_]+", open(os.path.join(PKG, f"{m}.py")).read()))
    assert found == {"ION_KV_TIER_GB"}
