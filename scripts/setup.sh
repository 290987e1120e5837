#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv (kept outside the clone, because the CUDA
# build of torch is ~5.5 GB and is worth reusing), the package with its extras, and Debian's
# mosquitto for the integration tests. The pip step always runs, so a missing dependency fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EDGEFL_VENV:-$HOME/.cache/edgefl/venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
echo "[setup] installing edgefl and its extras into $VENV"
# torch/torchvision pinned to the builds that import together here (see docs/INSTALL.md)
"$VENV/bin/pip" install -q --disable-pip-version-check \
  "torch==2.14.1" "torchvision==0.29.1" -e ".[cpu,broker,data,report,signing,ray,tracking,privacy,metrics,test]"
# the DCGAN face generator weights (FedKTL stand-in); its declared deps would pull wandb and a
# second torch, so install the wheel alone
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "gan-face-generate==1.1.1"
apt_install() {  # Debian packages the integration tests run (installed only when missing)
  echo "[setup] installing $* (Debian)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  apt_install mosquitto mosquitto-clients
fi
# a real Prometheus scrapes `coordinator serve --metrics-port` in the tests; promtool lints it.
# Optional: where it cannot be installed those tests skip, saying so; the product does not need it
if ! command -v prometheus >/dev/null 2>&1 && [ ! -x /usr/bin/prometheus ]; then
  apt_install prometheus || echo "[setup] prometheus not installed: its tests will skip"
fi
echo "[setup] done"
