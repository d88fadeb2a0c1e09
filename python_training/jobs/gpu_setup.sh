#!/usr/bin/env bash
# Makes a GPU machine that may be offline (Python and torch, nothing of ours) ready for
# python_training/jobs/gpu_run.py, and runs it:
#   bash python_training/jobs/gpu_setup.sh               setup only (stash, install, build)
#   bash python_training/jobs/gpu_setup.sh run ARGS...   setup, then gpu_run.py ARGS
# Safe at the start of every job: what is done is skipped. It
# 1. keeps the wheelhouse parts this job brought (.gpu/p1, .gpu/p2, ... from `python
#    python_training/jobs/gpu_carry.py prepare`; .gpu/state, a packed run) in runs/gpu-env, an
#    ignored folder that stays while the machine keeps its disk, so a later job need not bring
#    them again;
# 2. installs every wheel whose pieces are all there into runs/gpu-env/site (gpu_carry.py
#    assemble: sha256-checked, pip --no-index --no-deps);
# 3. builds jacobi_ext's extension against the machine's torch once per source state (CUDA on,
#    bf16 kernels for sm_90a: H100/H200) and puts _C next to the sources, as an in-place build;
# 4. with `run`: checks that everything is there, then runs gpu_run.py from the repo root with
#    --restore runs/gpu-env/state when a packed run came along.
# A fresh machine (or one whose disk was wiped) starts bare: a part it lacks is named in the error.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ENV="${JF_GPU_ENV:-$ROOT/runs/gpu-env}"
PY="${PYTHON:-python3}"
mkdir -p "$ENV/stash" "$ENV/site"
t0=$SECONDS

shopt -s nullglob
for d in "$ROOT"/.gpu/p[0-9]*/; do cp -f "$d"* "$ENV/stash/"; done
if [ -d "$ROOT/.gpu/state" ]; then
  rm -rf "$ENV/state" && cp -r "$ROOT/.gpu/state" "$ENV/state"
fi
set +e
"$PY" "$ROOT/python_training/jobs/gpu_carry.py" assemble --stash "$ENV/stash" --site "$ENV/site" \
  --wheelhouse "$ENV/wheelhouse"
missing=$?
set -e
export PYTHONPATH="$ROOT:$ENV/site${PYTHONPATH:+:$PYTHONPATH}"

# The extension: rebuilt only when its sources or the torch it is built against change.
src_hash=$( (cd "$ROOT" && find csrc CMakeLists.txt pyproject.toml -type f -print0 | sort -z \
  | xargs -0 sha256sum; "$PY" -c 'import torch; print(torch.__version__)') | sha256sum | cut -c1-16)
# JF_GPU_INSTALL=readme: no in-place build; bench/gpu_session.sh installs jacobi_ext the README's
# way (pip, every kernel, sm_80 and sm_90a) from the wheelhouse kept in $ENV/wheelhouse.
if [ "${JF_GPU_INSTALL:-}" != readme ] && [ -d "$ENV/site/cutlass_library" ] \
  && ! [ -f "$ENV/built-$src_hash" ]; then
  echo "== building jacobi_ext (CUDA, sm_90a, bf16 kernels) against torch $("$PY" -c 'import torch; print(torch.__version__)')"
  rm -rf "$ENV/wheel"
  (cd "$ROOT" && JACOBI_EXT_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip wheel -q \
    --no-build-isolation --no-deps --no-index -w "$ENV/wheel" \
    --config-settings=build-dir="$ENV/build" \
    --config-settings=cmake.define.JACOBI_EXT_CUDA_ARCHS=90a \
    --config-settings=cmake.define.JACOBI_EXT_CUDA_KERNELS=ci .)
  "$PY" - "$ENV/wheel" "$ROOT" <<'EOF'
import sys, zipfile, pathlib
whl = next(pathlib.Path(sys.argv[1]).glob("jacobi_ext-*.whl"))
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("jacobi_ext/_C") or n == "jacobi_ext/_build_info.py":
            z.extract(n, sys.argv[2])
            print("  in place:", n)
EOF
  rm -f "$ENV"/built-* && touch "$ENV/built-$src_hash"
  # The first GPU runs' builds crashed (SIGSEGV) inside _C whenever a check's message formatted
  # an integer (std::ostream::_M_insert<long> resolved inside _C.so); the same checks raise in a
  # build made on the CI box. What links libstdc++ code into _C here: compilers, the link line,
  # the libstdc++ symbols _C defines.
  so=$(ls "$ROOT"/jacobi_ext/_C*.so)
  {
    echo "== toolchain: $(c++ --version | head -1) | $(nvcc --version | tail -1)"
    echo "== _C .comment: $(readelf -p .comment "$so" 2>/dev/null | grep -o 'GCC.*\|clang.*' | sort -u | tr '\n' ';')"
    echo "== _C libstdc++ symbols defined: $(nm -DC --defined-only "$so" | grep -c 'std::') (dynamic)," \
      "ostream/locale ones: $(nm -DC --defined-only "$so" | grep -c '_M_insert\|codecvt\|num_put')"
    ldd "$so" | grep -E "stdc|gcc_s" || true
    (cd "$ENV/build" && ninja -t commands 2>/dev/null | grep -E -- "-o _C[^ ]*\.so" | tail -1 | cut -c1-1500)
    env | grep -E "^(LDFLAGS|CXXFLAGS|CFLAGS|CC|CXX|CUDAHOSTCXX)=" || true
  } 2>&1 | sed 's/^/   /'
fi
echo "== setup: $((SECONDS - t0)) s"

[ "${1:-}" = "run" ] || exit 0
shift
if [ "$missing" -ne 0 ] || ! [ -f "$ENV/built-$src_hash" ]; then
  echo "gpu_setup: this machine lacks pieces (above: \"missing\"): bring those .gpu/pN folders" \
    "(a fresh machine starts bare: bring them from .gpu/p1 again)" >&2
  exit 3
fi
cd "$ROOT"
"$PY" -c 'import torch, jacobi_ext.kernels._native as n, jacobi_ext.models as m
print("== torch", torch.__version__, "| GPU:", torch.cuda.get_device_name() if
      torch.cuda.is_available() else "none", "| jacobi_ext CUDA kernels:", n.WITH_CUDA,
      n.CUDA_ARCHS, "| model:", m.default_model_file())'
restore=()
[ -d "$ENV/state" ] && restore=(--restore "$ENV/state")
PYTHONUNBUFFERED=1 exec "$PY" -m python_training.jobs.gpu_run "${restore[@]}" "$@"
