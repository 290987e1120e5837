#!/usr/bin/env bash
# Coordinator ingest against the broker's own rate with N ingest workers, on a machine with
# more cores than this project's 2-core VM (a lent GPU machine's 16). One bench_coordinator.py
# invocation per worker count, so a run cut by the budget loses only itself; each prints its
# table row and a JSON-like record into $OUT.
#
#   OUT=/tmp/scale BUDGET=540 AGENTS=10000 WORKERS="0 2 4 8 1" bash benchmarks/scale_workers.sh
#
# The device image has no Mosquitto and no paho-mqtt: Debian 12's mosquitto 2.0.11 and the
# libraries it needs travel in .deb/ (`apt-get download mosquitto libwrap0 libdlt2
# libsystemd0 libcap2 libssl3`, git-ignored), paho-mqtt in .whl/ (name both in `carry`).
# Mosquitto runs through a wrapper that puts only its own libraries on LD_LIBRARY_PATH, and
# the system's first: Python never loads the carried ones.
set -u
OUT="${OUT:-/tmp/scale-workers}"
BUDGET="${BUDGET:-540}"
AGENTS="${AGENTS:-10000}"
ROUNDS="${ROUNDS:-3}"
WORKERS="${WORKERS:-0 2 4 8 1}"
mkdir -p "$OUT"
start=$(date +%s)
source benchmarks/device_env.sh
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  mq=/tmp/mq
  for f in .deb/mosquitto_*.deb .deb/libwrap0_*.deb .deb/libdlt2_*.deb; do dpkg -x "$f" "$mq"; done
  libs="$mq/usr/lib/x86_64-linux-gnu"
  if LD_LIBRARY_PATH="$libs" ldd "$mq/usr/sbin/mosquitto" | grep -q "not found"; then
    for f in .deb/libsystemd0_*.deb .deb/libcap2_*.deb .deb/libssl3_*.deb; do
      dpkg -x "$f" "$mq/fallback"
    done  # after the system's own directories: only what the system lacks comes from here
    libs="$libs:/usr/lib/x86_64-linux-gnu:$mq/fallback/usr/lib/x86_64-linux-gnu"
    libs="$libs:$mq/fallback/lib/x86_64-linux-gnu"
  fi
  mkdir -p "$mq/bin"
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$mq/usr/sbin/mosquitto" \
    >"$mq/bin/mosquitto"
  chmod +x "$mq/bin/mosquitto"
  export PATH="$mq/bin:$PATH"
fi
{
  echo "cpus $(nproc)"
  python3 -c "import sys, msgpack, numpy, paho.mqtt; print(sys.version.split()[0], numpy.__version__)"
  command -v mosquitto && LD_LIBRARY_PATH= mosquitto -h 2>&1 | head -1
  uptime
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for w in $WORKERS; do
  left=$((BUDGET - ($(date +%s) - start) - 10))
  if [ "$left" -lt 60 ]; then echo "workers $w: skipped, ${left}s left"; continue; fi
  timeout "$left" python3 benchmarks/bench_coordinator.py --agents "$AGENTS" \
    --rounds "$ROUNDS" --ingest-workers "$w" >"$OUT/workers_$w.txt" 2>&1
  echo "workers $w: exit $? after $(($(date +%s) - start)) s"
  tail -1 "$OUT/workers_$w.txt"
done
