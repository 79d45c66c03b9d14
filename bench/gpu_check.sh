#!/usr/bin/env bash
# The GPU path on one GPU machine: what the CPU test suite cannot show.
#
#   bash bench/gpu_check.sh            # from the repository root, with a CUDA build of torch
#
# 1. builds Horovod for this torch (NCCL ops when the NCCL of torch's wheels is there; falls back
#    to a build without GPU ops, which the staged allreduce still serves);
# 2. runs the GPU test module (pytest -m gpu tests/test_gpu.py): a CUDA run with channels_last and
#    bf16 that resumes with its optimizer state on the GPU, torch.compile on CUDA, two ranks sharing
#    the GPU per backend (Horovod staged through host memory, DDP over gloo) with a kill -9 of one
#    rank and a resume, and one rank through DDP's cpu:gloo,cuda:nccl group;
# 3. runs the demo chain with CUDA (profiles/default + bench/gpu_check.yaml, in a scratch dir);
# 4. runs the throughput benchmark (bench/train_throughput.py: bare torchvision loop vs chexflow's
#    full path vs the loader alone, same process) for ResNet-50 and DenseNet-121 at 224 px, bf16,
#    batch 256, and the optimizer step by kernel implementation (bench/optimizer_step.py);
#    `chexflow predict` against a plain decode-and-infer loop on 1,024 px PNG and DICOM files
#    (bench/predict.py, ResNet-50 at 224 px, batch 64) and its GPU test (tests/test_predict.py -m gpu).
# Results: bench/results/gpu_check-<stamp>.json (device, versions, each step's outcome and the
# throughput figures) plus the logs next to it. Exit status 0 only if every step passed.
#
# Offline machines: install the packages of envs/requirements.txt first (e.g. pip install
# --no-index --find-links WHEELS ...; keep the machine's own CUDA torch). FASHION_MNIST=<dir with the
# four Fashion-MNIST .gz files> when /usr/share/datasets/fashion-mnist is absent.
# CHEXFLOW_HOROVOD_SDIST=<horovod-0.28.1.tar.gz> builds Horovod from that file instead of downloading
# it; HOROVOD_BUILD_CUDA_CC_LIST=90 (Hopper) compiles its CUDA kernels for this GPU only.
# CHEXFLOW_GPU_CHECK_STEPS="tests demo bench" selects steps; BENCH_ARCHS="resnet50 densenet121".
# Time on an H200 (16 cores, 2026-11-28): set-up 30 s, Horovod build 2.7 min, tests 2.8 min, bench
# 3 min, demo 1.5 min: about 10.5 min in all. Where one command may run 10 min at most, run it in two
# (CHEXFLOW_GPU_CHECK_STEPS="tests", then "bench demo"); each step's seconds are in the summary.
#
# Inside chexflow's image (envs/Containerfile, docs/container.md), with this checkout bound into it:
#   bash bench/gpu_check.sh --image chexflow.sif       # apptainer exec --nv (singularity: CHEXFLOW_RUNNER)
#   CHEXFLOW_RUNNER=docker bash bench/gpu_check.sh --image chexflow:TAG     # docker run --gpus all
# The image's own .venv and Horovod are used (step 1 only reports them). Not tested on the machine
# the image was built on (no GPU, no Apptainer there): Apptainer itself, --nv, an image on a CUDA base
# (NGC PyTorch, CHEXFLOW_SKIP_TORCH=1) and its Horovod built with NCCL; this mode is where to check them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${1:-}" = --image ]; then
  image=${2:?--image needs a .sif file or an image name}
  runner=${CHEXFLOW_RUNNER:-apptainer}
  case "$runner" in
    apptainer|singularity)
      exec "$runner" exec --nv --bind "$PWD" --pwd "$PWD" --env CHEXFLOW_IN_IMAGE=1 "$image" bash bench/gpu_check.sh ;;
    docker|podman)
      exec "$runner" run --rm --gpus all -v "$PWD:$PWD" -w "$PWD" -e CHEXFLOW_IN_IMAGE=1 -e CHEXFLOW_GPU_CHECK_STEPS \
        --entrypoint bash "$image" bench/gpu_check.sh ;;
    *) echo "gpu_check: CHEXFLOW_RUNNER=$runner: apptainer, singularity, docker or podman" >&2; exit 2 ;;
  esac
fi
PY=${PYTHON:-python3}
RES=${CHEXFLOW_GPU_RESULTS:-bench/results}
STEPS=${CHEXFLOW_GPU_CHECK_STEPS:-"tests demo bench"}
ARCHS=${BENCH_ARCHS:-"resnet50 densenet121"}
WORKERS=${BENCH_WORKERS:-$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))}
mkdir -p "$RES"
stamp=$(date +%Y%m%d-%H%M%S)
say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
export PYTHONPATH="$PWD/workflow:$PWD/envs${PYTHONPATH:+:$PYTHONPATH}"   # envs/: the installers

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { say "no CUDA device visible to $PY: nothing to check"; exit 2; }
declare -A status

say "chexflow (editable, no dependency changes) and Horovod"
if [ "${CHEXFLOW_IN_IMAGE:-0}" = 1 ]; then    # the image's chexflow and Horovod, as built into it
  hvd=$("$PY" -c "import horovod.torch as h; print('nccl' if h.nccl_built() else 'no-gpu-ops')" \
        2>"$RES/install-$stamp.log")
  status[horovod_build]=${hvd:+image-$hvd}
  status[horovod_build]=${status[horovod_build]:-failed}
else
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$RES/install-$stamp.log" 2>&1 || true
  sdist=(${CHEXFLOW_HOROVOD_SDIST:+--sdist "$CHEXFLOW_HOROVOD_SDIST"})
  start=$(date +%s)
  if "$PY" -m chexflow_install.horovod "${sdist[@]}" >>"$RES/install-$stamp.log" 2>&1; then
    status[horovod_build]=nccl
  elif "$PY" -m chexflow_install.horovod --with-nccl no "${sdist[@]}" >>"$RES/install-$stamp.log" 2>&1; then
    status[horovod_build]=no-gpu-ops
  else
    status[horovod_build]=failed
  fi
  status[horovod_build_s]=$(( $(date +%s) - start ))
fi
say "horovod build: ${status[horovod_build]} (log $RES/install-$stamp.log)"

if [[ " $STEPS " == *" tests "* ]]; then
  say "GPU tests"
  start=$(date +%s)
  "$PY" -m pytest -m gpu tests/test_gpu.py tests/test_predict.py -v -p no:cacheprovider --junitxml "$RES/gpu_tests-$stamp.xml" \
    >"$RES/gpu_tests-$stamp.log" 2>&1 && status[tests]=passed || status[tests]=failed
  status[tests_s]=$(( $(date +%s) - start ))
  say "GPU tests: ${status[tests]} in ${status[tests_s]} s ($(tail -1 "$RES/gpu_tests-$stamp.log"))"
fi

if [[ " $STEPS " == *" demo "* ]]; then
  say "demo chain with CUDA"
  scratch=$(mktemp -d)
  overlays=("$PWD/config.yaml" "$PWD/bench/gpu_check.yaml")
  if [ -n "${FASHION_MNIST:-}" ]; then
    printf 'datasets:\n  fashion_mnist:\n    mirror: "%s"\n' "$FASHION_MNIST" >"$scratch/fashion_mnist.yaml"
    overlays+=("$scratch/fashion_mnist.yaml")
  fi
  start=$(date +%s)
  if "$PY" -m snakemake -s "$PWD/Snakefile" -d "$scratch" --profile profiles/default --cores all \
       --configfile "${overlays[@]}" >"$RES/demo-$stamp.log" 2>&1; then
    status[demo]=passed
    cp "$scratch/results/evaluate/metrics.json" "$RES/demo_metrics-$stamp.json" 2>/dev/null || true
    grep -h "device cuda" "$scratch"/logs/*/*.log >>"$RES/demo-$stamp.log" 2>/dev/null || true
  else
    status[demo]=failed
  fi
  status[demo_s]=$(( $(date +%s) - start ))
  say "demo: ${status[demo]} in ${status[demo_s]} s (log $RES/demo-$stamp.log, work dir $scratch)"
fi

if [[ " $STEPS " == *" bench "* ]]; then
  start=$(date +%s)
  for arch in $ARCHS; do
    say "throughput $arch (224 px, bf16, batch 256, $WORKERS loader workers)"
    backend=horovod
    [ "${status[horovod_build]}" = failed ] && backend=single
    if "$PY" bench/train_throughput.py --arch "$arch" --crop 224 --stored 256 --batch 256 --workers "$WORKERS" \
         --backend "$backend" --json "$RES/throughput-$arch-$stamp.json" >"$RES/throughput-$arch-$stamp.log" 2>&1; then
      status[bench_$arch]=done
    else
      status[bench_$arch]=failed
    fi
    say "$arch: ${status[bench_$arch]} ($(tail -1 "$RES/throughput-$arch-$stamp.log"))"
  done
  say "the loader's start per epoch: workers per pass vs once per run ($WORKERS workers)"
  "$PY" bench/loader_epoch_start.py --workers "$WORKERS" --batch 64 --steps 20 --passes 6 \
    --json "$RES/loader_epoch_start-$stamp.json" >"$RES/loader_epoch_start-$stamp.log" 2>&1 \
    && status[bench_loader_start]=done || status[bench_loader_start]=failed
  say "loader start: ${status[bench_loader_start]} ($(tail -1 "$RES/loader_epoch_start-$stamp.log"))"
  say "optimizer step by kernel implementation (for-loop / foreach / fused) on CUDA"
  arch_list=$(echo "$ARCHS" | tr ' ' ',')
  if "$PY" bench/optimizer_step.py --device cuda --archs "$arch_list" --optims adam,sgd \
       --json "$RES/optimizer_step-$stamp.json" >"$RES/optimizer_step-$stamp.log" 2>&1; then
    status[bench_optimizer]=done
  else
    status[bench_optimizer]=failed
  fi
  say "optimizer step: ${status[bench_optimizer]} (log $RES/optimizer_step-$stamp.log)"
  say "predict vs a plain loop (1,024 px PNG and DICOM, resnet50 at 224 px, batch 64) on CUDA"
  if "$PY" bench/predict.py --device cuda --arch resnet50 --n 256 --batch 64 --workers "$WORKERS" \
       --json "$RES/predict-$stamp.json" >"$RES/predict-$stamp.log" 2>&1; then
    status[bench_predict]=done
  else
    status[bench_predict]=failed
  fi
  say "predict: ${status[bench_predict]} ($(tail -1 "$RES/predict-$stamp.log"))"
  say "scale model: what a GPU session must measure (bench/scale_model.py --gpu-inputs), then its inputs here"
  "$PY" bench/scale_model.py --gpu-inputs >"$RES/scale_gpu_inputs-$stamp.txt" 2>&1 || true
  if "$PY" bench/scale_model.py --measure --json "$RES/scale_inputs-$stamp.json" >"$RES/scale_inputs-$stamp.log" 2>&1; then
    status[bench_scale_inputs]=done
  else
    status[bench_scale_inputs]=failed
  fi
  say "scale inputs: ${status[bench_scale_inputs]} (log $RES/scale_inputs-$stamp.log)"
  status[bench_s]=$(( $(date +%s) - start ))
fi

summary="$RES/gpu_check-$stamp.json"
statuses=$(for k in "${!status[@]}"; do printf '%s=%s\n' "$k" "${status[$k]}"; done)
STATUSES="$statuses" RES="$RES" STAMP="$stamp" "$PY" - "$summary" <<'PYEOF'
import glob, json, os, sys
import torch
try:
    import horovod
    hvd = horovod.__version__
except Exception:  # noqa: BLE001
    hvd = None
steps = dict(line.split("=", 1) for line in os.environ["STATUSES"].splitlines() if "=" in line)
bench = [json.load(open(p)) for p in sorted(glob.glob(f"{os.environ['RES']}/throughput-*-{os.environ['STAMP']}.json"))]
opt_path = f"{os.environ['RES']}/optimizer_step-{os.environ['STAMP']}.json"
optimizer = json.load(open(opt_path)) if os.path.exists(opt_path) else None
predict_path = f"{os.environ['RES']}/predict-{os.environ['STAMP']}.json"
predict = json.load(open(predict_path)) if os.path.exists(predict_path) else None
out = {"stamp": os.environ["STAMP"], "device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "horovod": hvd, "cpu_cores": len(os.sched_getaffinity(0)), "steps": steps,
       "throughput": bench, "optimizer_step": optimizer, "predict": predict}
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as fh:
    json.dump(out, fh, indent=1)
os.replace(tmp, sys.argv[1])
print(json.dumps(out, indent=1))
PYEOF
say "summary: $summary"
for k in "${!status[@]}"; do
  case "${status[$k]}" in failed) exit 1 ;; esac
done
exit 0
