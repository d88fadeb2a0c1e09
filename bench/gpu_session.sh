#!/usr/bin/env bash
# The GPU checks and figures as three stages, one job each with a time limit, on a GPU machine
# that may be offline; run them one after the other on the same machine, so that the later jobs
# find what the earlier ones installed and built (runs/gpu-env, kept while the machine keeps
# its disk):
#
#   job  | brings      | command                                   | what it does
#   1    | .gpu/p1     | bash bench/gpu_session.sh attention       | wheels, build (sm_90a, bf16
#        |             |                                           | kernels), attention tests (sm90,
#        |             |                                           | sm80, backends), attention bench
#   2    | .gpu/p2     | bash bench/gpu_session.sh kernels         | the other gpu tests: verify op,
#        |             |                                           | sampling, graphs, compiled step
#   3    | .gpu/p3     | bash bench/gpu_session.sh decoding        | the model; decoding bench (bf16,
#        |             |                                           | base, batch, 7B shape, distilled);
#        |             |                                           | fp32 lossless on SmolLM2
#
# (.gpu/pN: `python python_training/jobs/gpu_carry.py prepare --part-mib N`, the four wheels the
# machine lacks, the model among them, as a wheelhouse cut into parts.) Every step runs under a
# timeout taken from JF_DEADLINE_S (seconds for the whole job, default 540), so a hung kernel or a
# slow compile costs its own step, not the job. Logs and benchmark JSON go to $OUT (default
# runs/gpu-session): $OUT/<stage>.log and $OUT/*.json. Render them anywhere:
# jacobi-forcing bench --render-only --out DIR.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
stage="${1:?usage: bash bench/gpu_session.sh attention|kernels|decoding}"
OUT="${OUT:-$ROOT/runs/gpu-session}"
mkdir -p "$OUT"
LOG="$OUT/$stage.log"
DEADLINE=$((SECONDS + ${JF_DEADLINE_S:-540}))
PY="${PYTHON:-python3}"

say() { echo "== $(date +%T) [+${SECONDS}s] $*" | tee -a "$LOG"; }
# step SECONDS NAME CMD...: run CMD under min(SECONDS, time left), its output into the log.
step() {
  local want=$1 name=$2
  shift 2
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
  grep -E "passed|failed|error" "$LOG" | tail -n 1
}

say "stage $stage on $(hostname)"
bash python_training/jobs/gpu_setup.sh >>"$LOG" 2>&1 || say "gpu_setup: rc=$? (see the log)"
export PYTHONPATH="$ROOT:$ROOT/runs/gpu-env/site" PYTHONUNBUFFERED=1
# In-process gpu tests: a child per test (tests/gpu_isolation.py) costs a CUDA start each, more
# than a job with a time limit can spare; the step's timeout does the isolation's job (a hang
# ends the step).
export JACOBI_GPU_ISOLATION=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >>"$LOG" 2>&1
"$PY" -c 'import torch, jacobi_ext.kernels._native as n; print("torch", torch.__version__, "| CUDA kernels:",
  n.WITH_CUDA, n.CUDA_ARCHS)' >>"$LOG" 2>&1
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE -m gpu)
BENCH=("$PY" -m pytest -p no:cacheprovider -q -o "python_files=bench_*.py"
  --benchmark-columns=median,rounds)

case "$stage" in
  attention)
    step 60 sm90-tests "${PYTEST[@]}" tests/test_attention_sm90.py tests/test_attention_tile_lists.py \
      -k "not deterministic"
    # The deterministic dQ in its own step (its CTAs wait on each other's turns: a hang here must
    # not cost the figures of the steps after it).
    step 45 sm90-deterministic-tests "${PYTEST[@]}" tests/test_attention_sm90.py -k deterministic
    step 60 backends-tests "${PYTEST[@]}" tests/test_attention_backends.py
    # The sm_90a kernel in its own step: if it hangs, the anchors' figures are already saved.
    pick="(7b and (4096 or 16384) or forward) and not flex"
    step 60 attention-bench "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "$pick and not sm90" --benchmark-json="$OUT/attention_cuda.json"
    step 60 attention-bench-sm90 "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "$pick and sm90" --benchmark-json="$OUT/attention_cuda_sm90.json"
    step 90 attention-bench-variants "${BENCH[@]}" bench/bench_attention_cuda.py --benchmark-only \
      --benchmark-max-time=0.5 -k "variants" --benchmark-json="$OUT/attention_variants.json"
    # Every GPU attention test with sm90 as the kernel: the gate to make it the default on Hopper.
    step 120 sm90-as-default env JACOBI_ATTN_KERNEL=sm90 "${PYTEST[@]}" tests/test_attention_cuda.py \
      tests/test_attention.py -k "not argument_errors"
    # The raw ops' argument checks crashed (SIGSEGV) on both GPU runs, where jacobi_attention's
    # checks of the same inputs raised; cuda-gdb (H100, 2026-11-26): inside _C, formatting an
    # integer into the message (gpu_setup.sh prints the toolchain and link line since).
    crash='import sys; sys.path.insert(0, "tests"); import torch, jacobi_ext
from test_attention_cuda import jf_block_table, make_inputs
s, p, i = (t.cuda() for t in jf_block_table(0, 16, 2, "noisy_context"))
q, k, v = make_inputs(1, 2, 2, 64, 32, torch.bfloat16)
try:
    torch.ops.jacobi_ext.block_attention_fwd(q, k, v, s, p, i, 0.1)
except ValueError as e:
    print("raised as it should:", e)'
    step 20 crash-plain "$PY" -X faulthandler -u -c "$crash"
    step 120 cuda-tests "${PYTEST[@]}" tests/test_attention_cuda.py
    ;;
  kernels)
    # The compiled step's test compiles for ~45 s (H100, 2026-11-26: it took the rest of the step
    # and the 90 tests after it): last, in its own step.
    ign=(--ignore=tests/test_attention_sm90.py --ignore=tests/test_attention_cuda.py
      --ignore=tests/test_attention_backends.py --ignore=tests/test_attention_tile_lists.py
      --ignore=tests/test_attention.py)
    step 60 gpu-tests "${PYTEST[@]}" tests "${ign[@]}" -k "not compiled_step"
    step 90 gpu-tests-compiled "${PYTEST[@]}" tests "${ign[@]}" -k "compiled_step"
    ;;
  decoding)
    # Most wanted first: a step the deadline skips costs the least there. One pytest per compiled
    # variant: pytest-benchmark writes its JSON only at the end, and on the first H200 run
    # (2026-11-26) multiblock+compile (a compile per width bucket) outlasted its step and took
    # hf-static-compile's and ar+compile's figures with it.
    export JACOBI_BENCH_DEVICE=cuda JACOBI_BENCH_PROMPTS="${JF_PROMPTS:-4}"
    step 90 decoding-distilled env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_MODEL=smollm2-jf \
      JACOBI_BENCH_METHODS=hf-greedy,ar,jacobi,multiblock "${BENCH[@]}" bench/bench_decoding.py \
      -k test_decoding --benchmark-json="$OUT/decoding_distilled.json"
    for m in hf-static-compile ar+compile; do
      step 120 "decoding-$m" env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_PROMPTS=2 \
        JACOBI_BENCH_METHODS="hf-greedy,multiblock,$m" "${BENCH[@]}" bench/bench_decoding.py \
        -k test_decoding --benchmark-json="$OUT/decoding_${m//+/_}.json"
    done
    step 120 decoding-base env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_BATCH=1,2,4,8,16 \
      JACOBI_BENCH_METHODS=hf-greedy,ar,jacobi,multiblock "${BENCH[@]}" bench/bench_decoding.py \
      -k "test_decoding or test_batch or qwen7b" --benchmark-json="$OUT/decoding_base.json"
    step 60 decoding-fp32 env JACOBI_BENCH_DTYPE=float32 JACOBI_BENCH_PROMPTS=2 \
      JACOBI_BENCH_METHODS=hf-greedy,ar,jacobi,multiblock "${BENCH[@]}" bench/bench_decoding.py \
      -k test_decoding --benchmark-json="$OUT/decoding_fp32.json"
    step 150 decoding-multiblock+compile env JACOBI_BENCH_DTYPE=bf16 JACOBI_BENCH_PROMPTS=2 \
      JACOBI_BENCH_METHODS="hf-greedy,multiblock,multiblock+compile" "${BENCH[@]}" \
      bench/bench_decoding.py -k test_decoding --benchmark-json="$OUT/decoding_multiblock_compile.json"
    ;;
  *)
    echo "unknown stage $stage (attention, kernels, decoding)" >&2
    exit 2
    ;;
esac
say "stage $stage done"
tail -n 60 "$LOG" | grep -E "^==|passed|failed|FAILED|ERROR|Error" | tail -n 40
