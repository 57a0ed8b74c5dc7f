# Sourced by the device scripts (`source benchmarks/_install_wheels.sh || exit 1`): the wheels of ./.whl (carry
# .whl) installed into /tmp/site, and PYTHONPATH set to /tmp/site and the repo.
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD"
