#!/usr/bin/env bash
# Builds the full extension against the CUDA 13.0 build of torch (sm_80 and sm_90a), keeps the
# `-Xptxas -v` report, fails on any register spill, and imports the result on this GPU-less
# machine (calling a CUDA op here raises torch's "no NVIDIA driver" error, which is fine).
#
# Kernel set: JACOBI_CI_CUDA_KERNELS=gate (default) compiles the smallest set that still exercises
# the SASS gate: bfloat16, head dim 128, both kernel families (sm_80 forward + backward for sm_80
# and sm_90a, the sm_90a forward + backward). JACOBI_CI_CUDA_KERNELS=ci compiles every head dim
# once for bfloat16 (registers and spills do not depend on the 16-bit type; measured 1679 s on a
# loaded 2-core box, too long for CI); =full compiles what a GPU machine's build compiles.
#
# Then the SASS gate (.ci/sass_gate.py) reads the sm_90a object libraries' machine code (the
# attention's and the decode step's): HGMMA in the Hopper kernels, no HMMA, no local memory
# (LDL/STL), no "wgmma serialized" from ptxas.
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
kernel_set=${JACOBI_CI_CUDA_KERNELS:-gate}
venv=${JACOBI_CUDA_VENV:-/tmp/jacobi-ci-cuda-venv}
report_dir=build/ci
mkdir -p "$report_dir"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
pip install -q -r requirements/cuda-build.txt 2>&1 | grep -v "^WARNING: Location" || true
pip install -q --no-deps nvidia-cutlass==4.2.0.0 2>&1 | grep -v "^WARNING: Location" || true
pip install -q -r requirements/sass-gate.txt 2>&1 | grep -v "^WARNING: Location" || true
t_env=$(date +%s)
echo "== CUDA venv: $((t_env - t_start)) s"
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
export JACOBI_EXT_CUDA=ON
rm -rf build/ci-cuda /tmp/jacobi-cuda-wheel
echo "== CUDA kernel set: $kernel_set"
pip wheel -v --no-build-isolation --no-deps . -w /tmp/jacobi-cuda-wheel -Cbuild-dir=build/ci-cuda \
  -Ccmake.define.JACOBI_EXT_CUDA_KERNELS="$kernel_set" \
  > "$report_dir/cuda-build.log" 2>&1 || { tail -60 "$report_dir/cuda-build.log"; exit 1; }
t_built=$(date +%s)
echo "== CUDA build: $((t_built - t_env)) s"
grep -E "ptxas|bytes stack frame" "$report_dir/cuda-build.log" > "$report_dir/ptxas-report.txt" || true
echo "== ptxas report: $(wc -l < "$report_dir/ptxas-report.txt") lines, $(wc -c < "$report_dir/ptxas-report.txt") bytes ($report_dir/ptxas-report.txt)"
python .ci/check_ptxas.py "$report_dir/ptxas-report.txt" --require-arch sm_80 --require-arch sm_90a --table
t_gate=$(date +%s)
python .ci/sass_gate.py build/ci-cuda/CMakeFiles/jacobi_cuda_sm90.dir \
  build/ci-cuda/CMakeFiles/jacobi_cuda_decode.dir \
  --build-log "$report_dir/cuda-build.log" --require-hopper-kernels
echo "== SASS gate: $(($(date +%s) - t_gate)) s"
t_import=$(date +%s)
pip install -q --no-deps --force-reinstall /tmp/jacobi-cuda-wheel/jacobi_ext-*.whl
(cd /tmp && python - <<'PY'
import jacobi_ext, torch
info = jacobi_ext.build_info()
print("imported:", jacobi_ext.__version__, torch.ops.jacobi_ext, info)
assert info["cuda kernels"], "the CUDA build did not compile the CUDA kernels"
PY
) 2>&1 | grep -v -E "Failed to initialize NumPy|_conversion_method_template"
echo "== install + import: $(($(date +%s) - t_import)) s"
# The CUDA build's _C: no libstdc++ symbol exported, no libstdc++ code linked in (the build
# folder's unstripped _C and the installed one).
installed=$(cd /tmp && python -c 'import jacobi_ext, os; print(os.path.dirname(jacobi_ext.__file__))')
python .ci/check_cxx_runtime.py build/ci-cuda/_C*.so "$installed"/_C*.so

# The sm_90a kernels' register and shared-memory views, checked on the host with CuTe (the
# places where a kernel reinterprets registers and computes garbage without an error if wrong):
# tests/test_sm90_layouts.py::test_register_views_of_the_sm90_kernel, which the README test skips
# (its venv has no CUTLASS headers), run here where the headers are.
t_views=$(date +%s)
cutlass_inc=$(python -c "import cutlass_library, os; print(os.path.join(cutlass_library.__path__[0], 'source', 'include'))")
"$CUDA_PATH/bin/nvcc" -std=c++17 -O1 --expt-relaxed-constexpr -x cu -DJACOBI_WITH_CUTE \
  -Icsrc/include -Icsrc -isystem "$cutlass_inc" tests/cpp/sm90_host_check.cpp \
  -o build/ci/sm90_host_check
build/ci/sm90_host_check fragments | tee build/ci/sm90_host_check.txt
for want in "fragments D=64" "fragments D=128" "bwd fragments D=64" "bwd fragments D=128"; do
  grep -q "^$want: 256 threads, 0 bad" build/ci/sm90_host_check.txt \
    || { echo "sm90 register views: no '$want: 256 threads, 0 bad' line" >&2; exit 1; }
done
echo "== sm90 register views (host): $(($(date +%s) - t_views)) s"
echo "== CUDA compile check ($kernel_set kernels): $(($(date +%s) - t_start)) s wall"
