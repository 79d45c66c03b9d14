#!/usr/bin/env bash
# Build chexflow's OCI image (envs/Containerfile) with buildah; prints the image's name as its last line.
#
# Usage: bash envs/build-image.sh [--base IMAGE|mmdebstrap] [--tag TAG] [--skip-torch] [--nccl]
#                                 [--oci-archive FILE] [--wheel-cache DIR|none] [--new-base] [--python PREFIX]
#   --base mmdebstrap   (default) a Debian bookworm base made from the Debian archive by mmdebstrap,
#                       imported as localhost/chexflow-base:bookworm[-python<version>], reused while it exists
#                       (--new-base makes it again); no image registry needed (air-gapped sites)
#   --python PREFIX     (with mmdebstrap) a CPython installation (e.g. pyenv's ~/.pyenv/versions/3.11.7, its
#                       site-packages left out) copied into the base at the same path and used instead of
#                       Debian's python3 (3.11.2, which chexflow runs on: the default)
#   --base IMAGE        any Debian/Ubuntu image with python3, e.g. an NGC PyTorch image (with --skip-torch)
#   --skip-torch        keep the base's torch (CHEXFLOW_SKIP_TORCH=1); Horovod is built against it
#   --nccl              Horovod with NCCL allreduce (HOROVOD_GPU_OPERATIONS=NCCL; needs a CUDA base)
#   --tag TAG           the image's name (default localhost/chexflow:<commit>)
#   --oci-archive FILE  also write the image as an OCI archive (for `apptainer build x.sif oci-archive://FILE`)
#   --wheel-cache DIR   Horovod's wheel cache mounted into the build (default: $CHEXFLOW_WHEEL_CACHE or
#                       ~/.cache/chexflow/wheels, the host's); `none`: built inside and dropped
# pip's index settings (index-url, extra-index-url, find-links, cert: `pip config list`, PIP_* variables)
# are handed to the build, and the local directories and files they name are bind-mounted read-only.
# Needs buildah (and mmdebstrap for the default base): `apt-get install buildah mmdebstrap`.
# A second build of the same checkout reuses every cached layer (buildah --layers); a failed build leaves no
# working container behind (--force-rm). The build needs about CHEXFLOW_IMAGE_FREE_GB (default 24) GB free
# where buildah keeps its images and in its TMPDIR (the torch layer, ~7 GB, is written there while committed):
# it refuses to start with less.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BASE=mmdebstrap TAG="" SKIP_TORCH=0 NCCL="" ARCHIVE="" NEW_BASE=0 PYPREFIX=""
CACHE="${CHEXFLOW_WHEEL_CACHE:-$HOME/.cache/chexflow/wheels}"
BASE_NAME=localhost/chexflow-base:bookworm
usage() { sed -n '4,5p' "$0" | sed 's/^# //' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=${2:?--base needs IMAGE or mmdebstrap}; shift ;;
    --tag) TAG=${2:?--tag needs a name}; shift ;;
    --skip-torch) SKIP_TORCH=1 ;;
    --nccl) NCCL=NCCL ;;
    --oci-archive) ARCHIVE=${2:?--oci-archive needs a file}; shift ;;
    --wheel-cache) CACHE=${2:?--wheel-cache needs a directory or none}; shift ;;
    --new-base) NEW_BASE=1 ;;
    --python) PYPREFIX=${2:?--python needs an installation prefix}; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done
command -v buildah >/dev/null || { echo "build-image: buildah not found (apt-get install buildah)" >&2; exit 1; }
say() { printf '[build-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
ISOLATION=${BUILDAH_ISOLATION:-chroot}    # chroot: needs no user namespaces or cgroups (CI, login nodes)
PYTHON=python3
if [ -n "$PYPREFIX" ]; then
  [ "$BASE" = mmdebstrap ] || { echo "build-image: --python goes with --base mmdebstrap" >&2; exit 2; }
  PYPREFIX=$(cd "$PYPREFIX" && pwd)
  [ -x "$PYPREFIX/bin/python3" ] || { echo "build-image: --python $PYPREFIX: no bin/python3 there" >&2; exit 2; }
  PYTHON=$PYPREFIX/bin/python3
  BASE_NAME=$BASE_NAME-python$("$PYTHON" -c 'import platform; print(platform.python_version())')
fi

# ---------------------------------------------------------------- room for it
NEED_GB=${CHEXFLOW_IMAGE_FREE_GB:-24}
GRAPHROOT=$(buildah info --format '{{.store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)
for dir in "$GRAPHROOT" "${TMPDIR:-/var/tmp}"; do
  probe=$dir; while [ ! -d "$probe" ]; do probe=$(dirname "$probe"); done
  free_kb=$(df -Pk "$probe" | awk 'NR==2 {print $4}')
  if [ "$free_kb" -lt $(( NEED_GB * 1024 * 1024 )) ]; then
    echo "build-image: $dir has $(( free_kb / 1024 / 1024 )) GB free, the build needs about $NEED_GB GB" \
         "(images: buildah images; unused ones: buildah rmi --prune; stale working containers: buildah containers," \
         "buildah rm; CHEXFLOW_IMAGE_FREE_GB sets the threshold)" >&2
    exit 1
  fi
done

# ---------------------------------------------------------------- the base
if [ "$BASE" = mmdebstrap ]; then
  if [ "$NEW_BASE" = 1 ] || ! buildah inspect --type image "$BASE_NAME" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null \
      || { echo "build-image: mmdebstrap not found (apt-get install mmdebstrap)" >&2; exit 1; }
    MIRROR=${CHEXFLOW_DEBIAN_MIRROR:-http://deb.debian.org/debian}
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    say "base: mmdebstrap bookworm from $MIRROR"
    # (the libraries a CPython built on bookworm links, for --python)
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libssl3,libffi8,libsqlite3-0,\
libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgdbm6,libuuid1,zlib1g,libexpat1,libtirpc3 bookworm "$tmp/rootfs.tar" \
      "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
      "deb ${MIRROR%/debian}/debian-security bookworm-security main" </dev/null >&2
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$tmp/rootfs.tar" / >&2
    if [ -n "$PYPREFIX" ]; then
      say "base: Python from $PYPREFIX (without its site-packages)"
      tar -C / --exclude="${PYPREFIX#/}/lib/python3*/site-packages/*" -cf "$tmp/python.tar" "${PYPREFIX#/}"
      buildah add --quiet "$ctr" "$tmp/python.tar" / >&2
    fi
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --label org.opencontainers.image.title=chexflow-base "$ctr"
    buildah commit --quiet --rm "$ctr" "$BASE_NAME" >&2
    say "base: $BASE_NAME"
  else
    say "base: $BASE_NAME (exists; --new-base makes it again)"
  fi
  BASE=$BASE_NAME
fi

# ---------------------------------------------------------------- what the image records
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  COMMIT="$COMMIT-dirty"
fi
PINS=$(grep -E '^[A-Za-z0-9_.-]+==' envs/requirements.txt | sort -u | tr '\n' ' ')
TAG=${TAG:-localhost/chexflow:${COMMIT:0:12}}

# ---------------------------------------------------------------- pip's index, Horovod's wheel cache
args=() mounts=()
pip_setting() {   # the first value pip reports for KEY (environment before files), empty if none
  python3 -m pip config list 2>/dev/null | sed -n "s/^[^ ]*\.$1='\(.*\)'\$/\1/p" | head -n1
}
mount_local() {   # bind-mount a local directory or file named by a pip setting (file:// URL or path)
  local p=${1#file://}
  case "$p" in /*) ;; *) return 0 ;; esac
  [ "$(basename "$p")" = simple ] && p=$(dirname "$p")    # an index's links point next to simple/
  [ -e "$p" ] && mounts+=(-v "$p:$p:ro")
  return 0
}
for key in index-url extra-index-url find-links cert; do
  var=PIP_$(echo "$key" | tr a-z- A-Z_)
  val=${!var:-$(pip_setting "$key")}
  [ -n "$val" ] || continue
  args+=(--build-arg "$var=$val")
  for item in $val; do mount_local "$item"; done
done
if [ "$CACHE" != none ]; then
  mkdir -p "$CACHE"
  mounts+=(-v "$(cd "$CACHE" && pwd):/var/cache/chexflow/wheels")
fi

# ---------------------------------------------------------------- build
say "image: $TAG from $BASE (commit $COMMIT, isolation $ISOLATION)"
start=$(date +%s)
buildah bud --isolation "$ISOLATION" --layers --force-rm -f envs/Containerfile -t "$TAG" \
  --build-arg BASE="$BASE" --build-arg PYTHON="$PYTHON" --build-arg CHEXFLOW_SKIP_TORCH="$SKIP_TORCH" \
  --build-arg HOROVOD_GPU_OPERATIONS="$NCCL" --build-arg CHEXFLOW_COMMIT="$COMMIT" \
  --build-arg CHEXFLOW_PINS="$PINS" "${args[@]}" "${mounts[@]}" . >&2
say "built in $(( $(date +%s) - start )) s; size: $(buildah images --format '{{.Size}}' "$TAG" | head -n1)"
if [ -n "$ARCHIVE" ]; then
  rm -f "$ARCHIVE"
  buildah push --quiet "$TAG" "oci-archive:$ARCHIVE:$TAG" >&2
  say "OCI archive: $ARCHIVE"
fi
echo "$TAG"
