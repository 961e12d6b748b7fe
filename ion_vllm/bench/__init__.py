"""A/B benchmark suite: ION vs vLLM's stock attention (``ion-bench``).

Modules: ``kernel_suite`` (named shapes, bytes/FLOPs), ``kernel_runner`` (GPU
timing of each backend), ``e2e`` (vLLM ``bench throughput`` / ``bench serve``
drivers), ``report`` (summary.json merge, table.md, plot.png), ``cli`` (entry
point ``main``).  Importing this package does not import torch or vLLM.
"""

__all__ = ["cli", "e2e", "kernel_runner", "kernel_suite", "report"]
