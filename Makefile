# Two commands that work on a fresh machine: `make demo` (the main job) and `make test`.
# Both create/update the virtualenv .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines of this project have torch 2.13.0 (CPU build) on disk; elsewhere any torch >= 2.6 works.
TORCH_SPEC ?= torch==2.13.0
# The Triton kernels' tests also run on CPU, in Triton's interpreter (same Triton as the GPU box): single-threaded
# Python, so they run in KERNEL_TEST_WORKERS pytest-xdist processes (2 on the 2-core CI machine: 15 -> 8 minutes).
TRITON_SPEC ?= triton==3.6.0
KERNEL_TEST_WORKERS ?= 2
# NVRTC (no GPU needed) cross-compiles the CUDA GEMMs (kernels/moe_mma.cu, moe_wgmma.cu) for sm_90(a) in the SASS tests.
# Those tests use one core, and so does the SGLang venv's pip install: the venv builds beside them (about a minute).
NVRTC_SPEC ?= nvidia-cuda-nvrtc==13.0.88
STAMP := $(VENV)/.installed
# SGLang 0.5.10 pins torch 2.9.1; its Python registries import beside torch 2.14.1 in a separate venv.
SGLANG_VENV ?= .venv-sglang

.PHONY: demo demo-quant test test-fast lint clean

$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[all-cpu]"
	touch $(STAMP)

demo: $(STAMP)
	TORCHDYNAMO_DISABLE=1 $(PY) examples/rl_demo.py

demo-quant: $(STAMP)
	$(PY) -m megatron_trace.cli.demo_quant

test: $(STAMP)
	TORCHDYNAMO_DISABLE=1 $(PY) -m pytest -q -p no:cacheprovider tests
	$(PY) -m pip install -q "$(TRITON_SPEC)"
	TRITON_INTERPRET=1 TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider \
		-n $(KERNEL_TEST_WORKERS) tests/kernels
	$(PY) -m pip install -q "$(NVRTC_SPEC)"
	bash tests/sglang/setup_venv.sh $(SGLANG_VENV) > $(VENV)/sglang-setup.log 2>&1 & setup=$$!; \
	TORCHDYNAMO_DISABLE=1 $(PY) -m pytest -q -p no:cacheprovider tests/benchmarks/test_sass_kv_attention.py \
		tests/benchmarks/test_sass_moe_gemm.py tests/benchmarks/test_sass_moe_mma.py tests/benchmarks/test_sass_moe_wgmma.py \
		tests/benchmarks/test_sass_quant.py tests/benchmarks/test_bench_quant.py tests/benchmarks/test_bench_host_overhead.py \
		tests/benchmarks/test_moe_shapes.py; \
	rc=$$?; wait $$setup || { cat $(VENV)/sglang-setup.log; echo "tests/sglang/setup_venv.sh failed"; exit 1; }; \
	tail -1 $(VENV)/sglang-setup.log; exit $$rc
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/sglang

test-fast: $(STAMP)
	TORCHDYNAMO_DISABLE=1 $(PY) -m pytest -q -m "not slow" tests

lint: $(STAMP)
	$(PY) -m ruff check megatron_trace tests benchmarks

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
