"""Chunk B's adapter (shipped until 2026-11-26 noon, from git) at another strength: its LoRA B
matrices times s (the update B·A scales by s; s = 0 is the base model, 1 the adapter as trained).

    python docs/results/fidelity-cpu-2026-11-26/scale_adapter.py 0.5 0.75 1.25  # runs/scale/s<s>
    jacobi-forcing fidelity --model runs/scale/s0.5 --threads 1 \
        --reference docs/results/eval-cpu-2026-11-26/base-humaneval-164.jsonl --out scale-0.5.json
"""

import subprocess
import sys
from pathlib import Path

from safetensors.torch import load, save_file

CHUNK_B = "6fcf744"  # the last commit that shipped chunk B's adapter
FOLDER = "jacobi_ext/adapters/smollm2-jf"


def from_git(name: str) -> bytes:
    return subprocess.run(["git", "show", f"{CHUNK_B}:{FOLDER}/{name}"], check=True,
                          capture_output=True).stdout  # fmt: skip


for s in map(float, sys.argv[1:]):
    dst = Path(f"runs/scale/s{s}")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "train_state.json"):
        (dst / name).write_bytes(from_git(name))
    w = load(from_git("adapter_model.safetensors"))
    save_file({k: v * s if "lora_B" in k else v for k, v in w.items()},
              dst / "adapter_model.safetensors")  # fmt: skip
    print(dst)
