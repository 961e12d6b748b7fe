"""ion-vllm: the ION attention backend (IonAttention, CuTeDSL Hopper kernel) for vLLM 0.26."""

from setuptools import find_packages, setup

setup(
    name="ion-vllm",
    version="0.1.0",
    description="ION: a CuTeDSL paged-attention backend for vLLM on Hopper (sm_90) GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["ion_vllm", "ion_vllm.*", "cute_kernels", "cute_kernels.*"]),
    install_requires=[
        "vllm==0.26.0",
        "nvidia-cutlass-dsl[cu13]==4.6.0",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "matplotlib"],
    },
    entry_points={
        "vllm.general_plugins": [
            "ion = ion_vllm:register",
        ],
        "console_scripts": [
            "ion-bench = ion_vllm.bench.cli:main",
        ],
    },
)
