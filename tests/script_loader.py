"""Import a file under scripts/ as a module (scripts/ is not a package)."""

import importlib.util
import os
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
# scripts import their sibling modules (start_gate, gpu_busy) as a script run would
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)


def load_script(filename: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(SCRIPTS, filename))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod
    spec.loader.exec_module(mod)
    return mod
