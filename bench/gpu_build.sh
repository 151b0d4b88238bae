#!/usr/bin/env bash
# Builds Taper's extensions HERE for the lent GPU machine, so that nothing is compiled there
# (issue 26): its Python (3.12), its numpy ABI (2.5), its GPU (TAPER_CUDA_ARCHS=90a: H100/H200).
#
#     bash bench/gpu_build.sh      # -> .gpu-prebuilt/ (git-ignored); carry it with .whl
#
# The build runs in a git worktree of HEAD under $TAPER_GPU_BUILD (default /tmp/taper-gpu-build,
# kept between runs: setup.py rebuilds only what changed, about 150 s from scratch on 2 cores)
# with a Python 3.12 virtual environment of the build requirements beside it. The extensions are
# stripped of debug information and stamped (bench/gpu_prebuilt.py: the commit and the SHA-256 of
# every source they were built from); the GPU suite installs them only where the tree it runs on
# has those very sources. Commit first: the build is of HEAD, and uncommitted source changes make
# the stamp disagree with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
BUILD="${TAPER_GPU_BUILD:-/tmp/taper-gpu-build}"
DEST="$REPO/.gpu-prebuilt"
ARCHS="${TAPER_CUDA_ARCHS:-90a}"
NUMPY="numpy==2.5.2"          # the GPU machine's image (KINDS.md, 2026-11)

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu-prebuilt/' "$exclude" 2>/dev/null || echo '/.gpu-prebuilt/' >> "$exclude"

py312="${PY312:-}"
if [ -z "$py312" ]; then
    for cand in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if command -v "$cand" > /dev/null 2>&1; then py312="$(command -v "$cand")"; break; fi
    done
fi
[ -n "$py312" ] || { echo "gpu_build: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2; exit 2; }

mkdir -p "$BUILD"
if [ ! -x "$BUILD/venv/bin/python" ]; then
    "$py312" -m venv "$BUILD/venv"
fi
"$BUILD/venv/bin/python" -m pip install -q "$NUMPY" "Cython>=3.0" "setuptools>=69" wheel \
    "nvidia-cutlass==$(sed -n 's/^CUTLASS_VERSION = "\(.*\)".*/\1/p' setup.py)"

head="$(git rev-parse HEAD)"
if [ -e "$BUILD/src/.git" ]; then
    git -C "$BUILD/src" checkout -q --detach "$head"
else
    rm -rf "$BUILD/src"
    git worktree add -q --detach "$BUILD/src" "$head"
fi

echo "gpu_build: $(git log -1 --format='%h %s' "$head" | cut -c1-100)"
echo "gpu_build: Python $("$BUILD/venv/bin/python" -c 'import sys; print(sys.version.split()[0])'), TAPER_CUDA_ARCHS=$ARCHS"
(cd "$BUILD/src" && TAPER_CUDA_ARCHS="$ARCHS" "$BUILD/venv/bin/python" setup.py build_ext --inplace -q)

rm -rf "$DEST"
mkdir -p "$DEST/pyx"
cp "$BUILD"/src/pyx/*.cpython-312-*.so "$DEST/pyx/"
strip --strip-debug "$DEST"/pyx/*.so
(cd "$BUILD/src" && TAPER_CUDA_ARCHS="$ARCHS" "$BUILD/venv/bin/python" -m bench.gpu_prebuilt stamp "$DEST")
du -sh "$DEST"
ls -la "$DEST/pyx"
