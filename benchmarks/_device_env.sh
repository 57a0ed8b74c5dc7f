# Sourced by the device scripts: $OUT, unbuffered Python, no dynamo, the wheels of ./.whl installed into /tmp/site
# (carry .whl) and on PYTHONPATH with the repo and benchmarks/.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
source benchmarks/_install_wheels.sh || exit 1
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"
