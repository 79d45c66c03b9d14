#!/usr/bin/env bash
# Third lease (one command, one deadline): what the first two left open. The GPU tests (DDP kill -9 and
# resume, predict CUDA == CPU after the TF32 fix, init: file on CUDA, and the rest again), the demo chain
# to its report on CUDA, the Horovod-backend throughput, ResNet-50 at the per-GPU batch 64 (scale model
# input 1). Horovod builds in the background meanwhile; results tarred into $OUT as they come.
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-545}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }
say() { printf '[drv +%3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH="$PWD/workflow:$PWD/envs" HOROVOD_BUILD_CUDA_CC_LIST=90
R=bench/results/lease3; mkdir -p $R
pack() { tar -czf "$OUT/results.tgz.tmp" $R 2>/dev/null && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
( while sleep 20; do pack; done ) & WATCH=$!
{ nvidia-smi -L; nproc; python3 -c "import sys,torch,torchvision,scipy,numpy;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torchvision.__version__, scipy.__version__, numpy.__version__, torch.cuda.get_device_name())"; } >$R/info.log 2>&1
say "$(cat $R/info.log | tr '\n' ' ')"
python3 -m pip install -q --no-deps --no-index $(ls .whl/*.whl) >$R/pip.log 2>&1; say "wheels rc=$?"
python3 -m pip install -q --no-deps --no-build-isolation -e . >>$R/pip.log 2>&1; say "editable rc=$?"
python3 -c "import chexflow.data.archives, snakemake, webdataset, captum, pydicom, simplejpeg; from scipy.stats import poisson_binom; print('imports ok')" 2>&1 | tail -2
( s=$(date +%s); if timeout 300 python3 -m chexflow_install.horovod --sdist .whl/horovod-0.28.1.tar.gz >$R/horovod.log 2>&1; then echo "nccl $(( $(date +%s) - s ))"; \
  else echo "failed $(( $(date +%s) - s ))"; fi ) >$R/horovod.status 2>&1 & HB=$!
say "horovod build started; GPU tests (horovod's own excluded: passed in lease 1)"
timeout -k 5 $(cap 240) python3 -m pytest -m gpu tests/test_gpu.py tests/test_predict.py -k "not horovod" -v -p no:cacheprovider \
  --durations=0 --junitxml $R/gpu_tests.xml >$R/gpu_tests.log 2>&1; say "gpu tests rc=$? $(tail -1 $R/gpu_tests.log)"
grep -E "(PASSED|FAILED|ERROR)( |$)" $R/gpu_tests.log | grep :: | cut -c1-150
while kill -0 $HB 2>/dev/null && [ "$(left)" -gt 260 ]; do sleep 2; done
say "horovod: $(cat $R/horovod.status 2>/dev/null) $(grep -h 'horovod-install' $R/horovod.log | grep -E 'wheel: built|verify' | tr '\n' ' ')"
kill -0 $HB 2>/dev/null && { say "horovod still building: the demo uses DDP"; pkill -f chexflow_install; }
overlays=("$PWD/config.yaml" "$PWD/bench/gpu_check.yaml")
if ! grep -q '^nccl' $R/horovod.status 2>/dev/null; then
  printf 'pretrain:\n  backend: ddp\nfinetune:\n  backend: ddp\n' >$R/ddp.yaml; overlays+=("$PWD/$R/ddp.yaml"); fi
scratch=$(mktemp -d); s=$(date +%s)
timeout -k 5 $(cap 190) python3 -m snakemake -s "$PWD/Snakefile" -d "$scratch" --profile profiles/default --cores all \
  --configfile "${overlays[@]}" >$R/demo.log 2>&1; rc=$?
say "demo rc=$rc in $(( $(date +%s) - s )) s: $(grep -E 'steps \(100%\) done|of [0-9]+ steps' $R/demo.log | tail -1)"
cp "$scratch"/results/evaluate/metrics.json $R/demo_metrics.json 2>/dev/null; ls "$scratch"/results/report* >$R/demo_report_files.txt 2>&1
grep -h "device cuda" "$scratch"/logs/*/*.log 2>/dev/null | head -5 >>$R/demo.log
for f in "$scratch"/logs/report*/*.log "$scratch"/logs/report*.log; do [ -f "$f" ] && tail -30 "$f" >>$R/demo_report_job.log; done
grep -q '^nccl' $R/horovod.status 2>/dev/null && { timeout -k 5 $(cap 70) python3 bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --batch 256 \
  --workers 14 --backend horovod --json $R/throughput-resnet50-horovod.json >$R/throughput-resnet50-horovod.log 2>&1
  say "resnet50 horovod rc=$? $(grep -E 'img/s' $R/throughput-resnet50-horovod.log | tr -s ' ' | tr '\n' ';')"; }
timeout -k 5 $(cap 60) python3 bench/train_throughput.py --arch resnet50 --crop 224 --stored 256 --batch 64 \
  --workers 14 --backend single --json $R/throughput-resnet50-b64.json >$R/throughput-resnet50-b64.log 2>&1
say "resnet50 batch 64 rc=$? $(grep -E 'img/s' $R/throughput-resnet50-b64.log | tr -s ' ' | tr '\n' ';')"
kill $WATCH 2>/dev/null; pack; say "packed $(du -h $OUT/results.tgz | cut -f1)"
