from setuptools import find_packages, setup

EXTRAS = {
    # psutil: megatron-core's torch_dist checkpoint writer imports it (undeclared); without it a save hangs
    "megatron": ["megatron-core==0.16.1", "einops", "mbridge==0.15.1", "psutil"],
    "hf": ["transformers>=5.24,<6", "safetensors>=0.4"],
    "examples": ["hydra-core>=1.3", "omegaconf>=2.3", "matplotlib>=3.7", "tqdm>=4.60", "tensorboard>=2.14"],
    "sglang": ["sglang==0.5.10.post1"],
    "te": ["transformer-engine[pytorch]>=2.5"],  # 2.5: GroupedLinear._get_weight_tensors (te.py)
    "gpu": ["triton>=3.1"],
    "dev": ["pytest>=8", "pytest-xdist>=3", "pytest-timeout>=2", "hypothesis>=6", "ruff>=0.5", "numpy>=1.24"],
}
EXTRAS["all-cpu"] = sorted({r for k in ("megatron", "hf", "examples", "dev") for r in EXTRAS[k]})

setup(
    name="megatron_trace",
    version="0.1.0",
    description="TRACE: rollout-guided FP4 QAT for MoE reinforcement learning with Megatron-Core and SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_trace", "megatron_trace.*"]),
    package_data={"megatron_trace.kernels": ["*.cu"]},  # (CUDA sources compiled at run time by NVRTC)
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "safetensors>=0.4"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["trace-demo-quant=megatron_trace.cli.demo_quant:main"]},
)
