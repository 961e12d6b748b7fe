"""A/B benchmarks of ION against vLLM's stock attention (``ion-bench``, bench/README.md).

Modules: ``kernel_suite`` (named shapes, bytes/FLOPs), ``kernel_runner`` (GPU timing of
each registered backend), ``e2e`` (vLLM ``bench throughput`` / ``serve`` drivers),
``startup`` (``vllm serve`` time-to-ready), ``report`` (summary.json, table.md, plot.png),
``cli`` (entry point ``main``).  Importing this package imports neither torch nor vLLM.
"""
