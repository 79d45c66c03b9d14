#!/usr/bin/env bash
# Set up chexflow on a fresh machine, idempotently (a second run only checks):
#   system packages (Debian/Ubuntu, when run as root): Fashion-MNIST data package, OpenMPI
#   (Horovod's MPI ops for `srun --mpi=pmix`), and with --test: Chromium (report rendering
#   test), procps, and buildah, mmdebstrap and iproute2 (the container image test); the local SLURM
#   test cluster installs its own packages;
#   .venv with envs/requirements.txt: the pinned packages and chexflow itself (editable) with every
#   group of pyproject.toml (the one list of what chexflow needs), the SLURM executor plugin patched
#   for its node-failure bug, torchvision's import without TorchDynamo, and Horovod 0.28.1 built
#   against the installed torch (cached wheel under ~/.cache/chexflow/wheels); all by the installers in
#   envs/chexflow_install (build tooling, not part of the chexflow package), run with envs/ on
#   PYTHONPATH: python -m chexflow_install.slurm_plugin, python -m chexflow_install.torchvision_dynamo,
#   python -m chexflow_install.torch_dynamo
#   and python -m chexflow_install.horovod.
#
# Usage: bash envs/setup.sh [--test] [--pins-only]
# --pins-only: the venv and the pinned packages of envs/requirements.txt alone, no system package
# (envs/Containerfile runs it before it copies the checkout, so a new commit reuses that layer).
# Cluster users: load your site's compilers/CUDA/MPI modules first; set CHEXFLOW_SKIP_TORCH=1 to
# keep a torch you installed yourself (Horovod is then built against it); HOROVOD_* variables
# (HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME, ...) and MPICXX are passed to the Horovod build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WITH_TESTS=0 PINS_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TESTS=1 ;;
    --pins-only) PINS_ONLY=1 ;;     # .venv with the pinned packages alone (the image's cached layer)
    *) echo "usage: bash envs/setup.sh [--test] [--pins-only]" >&2; exit 2 ;;
  esac
done
# an empty PIP_*/HOROVOD_* variable (a build argument left empty) is not "unset" to pip or Horovod
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT HOROVOD_GPU_OPERATIONS HOROVOD_WITHOUT_GLOO; do
  [ -n "${!v:-}" ] || unset "$v"
done

PY=${PYTHON:-python3}
say() { printf '\n[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# ---------------------------------------------------------------- system packages
pkgs=(dataset-fashion-mnist libopenmpi-dev openmpi-bin cmake g++)
[ "$PINS_ONLY" = 1 ] && pkgs=()
[ "$WITH_TESTS" = 1 ] && pkgs+=(chromium procps buildah mmdebstrap iproute2)
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}"; }
  fi
else
  say "not root or no apt-get: make sure these are installed: ${pkgs[*]}"
fi

# ---------------------------------------------------------------- Python environment
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
say "installing Python packages and chexflow (envs/requirements.txt)"
.venv/bin/pip install -q --upgrade pip wheel setuptools
# (its `-e .[...]` line is relative to this directory, the checkout, not to the file)
skip='^$'
[ "${CHEXFLOW_SKIP_TORCH:-0}" = 1 ] && skip='^(torch|torchvision)=='
[ "$PINS_ONLY" = 1 ] && skip="$skip|^-e "
grep -vE "$skip" envs/requirements.txt > .venv/requirements-install.txt
.venv/bin/pip install -q -r .venv/requirements-install.txt
if [ "$PINS_ONLY" = 1 ]; then
  say "pinned packages installed; chexflow itself, the plugin's fix and Horovod: bash envs/setup.sh"
  exit 0
fi

# the installers (envs/chexflow_install) run with envs/ in front of the module path
installer() { PYTHONPATH="$PWD/envs${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m "chexflow_install.$1"; }

say "snakemake-executor-plugin-slurm: the node-failure fix (envs/patches/slurm-plugin-node-fail.md)"
installer slurm_plugin

say "torchvision: import it without TorchDynamo (envs/patches/torchvision-dynamo-import.md)"
installer torchvision_dynamo

say "torch: optimizers without TorchDynamo when nothing compiles (envs/patches/torch-dynamo-import.md)"
installer torch_dynamo

say "Horovod (built once against this torch, then taken from the wheel cache)"
installer horovod

say "ready: $(.venv/bin/python -c 'import torch, horovod; print("torch", torch.__version__, "| horovod", horovod.__version__)')"
