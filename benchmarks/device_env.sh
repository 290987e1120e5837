# Sourced by the scripts that run on a lent device machine (gpu_checks.sh, scale_workers.sh):
# the wheels its image lacks, carried in .whl/ (paho-mqtt, mlxtend, gan-face-generate), then
# this checkout on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
