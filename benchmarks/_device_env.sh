# Sourced by the device scripts: $OUT, unbuffered Python, no dynamo, the wheels of ./.whl installed into /tmp/site
# (carry .whl) and on PYTHONPATH with the repo and benchmarks/.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
