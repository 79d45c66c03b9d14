#!/usr/bin/env bash
# Fourth, short lease: is the gap at batch 64 (full 0.74x bare, 60 steps per epoch) the per-epoch pipeline
# fill (loader workers start each epoch)? The same run with 4x the steps per epoch, and batch 32 (scale input 1).
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-200}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }
say() { printf '[drv +%3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$PWD/workflow:$PWD/envs"
R=bench/results/lease4; mkdir -p $R
pack() { tar -czf "$OUT/results.tgz.tmp" $R 2>/dev/null && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
( while sleep 20; do pack; done ) & WATCH=$!
python3 -m pip install -q --no-deps --no-index $(ls .whl/*.whl) >$R/pip.log 2>&1; say "wheels rc=$?"
python3 -m pip install -q --no-deps --no-build-isolation -e . >>$R/pip.log 2>&1; say "editable rc=$?"
for spec in "64 240" "32 240" "64 60"; do set -- $spec
  timeout -k 5 $(cap 70) python3 bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --batch $1 --steps $2 \
    --workers 14 --backend single --json $R/throughput-resnet50-b$1-s$2.json >$R/throughput-resnet50-b$1-s$2.log 2>&1
  say "resnet50 batch $1 steps $2 rc=$? $(grep -E 'img/s|epoch_time' $R/throughput-resnet50-b$1-s$2.log | grep -o 'epoch_time_s": [0-9.]*\|[a-z ]*: *[0-9.]* img/s' | tr '\n' ';')"
done
kill $WATCH 2>/dev/null; pack; say "packed"
