"""Chunk I2 and chunk J averaged in weight space (½ each), cut back to one rank-16 LoRA adapter.

Both continue H's adapter for 1 000 steps on the same collection (J: every answer that ended
within 256 tokens; I2: those that ended within 128). Each module's update ½·B₁A₁ + ½·B₂A₂ is cut
to its best rank-16 approximation by chunk C2's `best_rank` (the relative Frobenius error of the
cut is printed and kept in `train_state.json`).

    python docs/results/distill-cpu-2026-11-27/soup_i2_j.py      # -> runs/soup-i2-j
"""

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "soup_c2", HERE.parent / "distill-cpu-2026-11-24/chunk-c2/soup_adapters.py"
)
_c2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_c2)

I2, J = Path("runs/chunkI2/adapter"), Path("runs/chunkJ/adapter")
DST = Path("runs/soup-i2-j")


def main(w: float = 0.5, rank: int = 16) -> None:
    x, y = (load_file(d / "adapter_model.safetensors") for d in (I2, J))
    out, err, norm = {}, 0.0, 0.0
    for ka in (k for k in x if "lora_A" in k):
        kb = ka.replace("lora_A", "lora_B")
        b = torch.cat([w * x[kb].float(), (1 - w) * y[kb].float()], dim=1)
        a = torch.cat([x[ka].float(), y[ka].float()], dim=0)
        out[kb], out[ka] = _c2.best_rank(b, a, rank)
        full = b.double() @ a.double()
        err += (full - out[kb].double() @ out[ka].double()).square().sum().item()
        norm += full.square().sum().item()
    DST.mkdir(parents=True, exist_ok=True)
    shutil.copy(J / "adapter_config.json", DST)
    save_file(out, DST / "adapter_model.safetensors")
    cut = (err / norm) ** 0.5
    state = json.loads((J / "train_state.json").read_text())
    state["merge"] = {"of": {str(I2): w, str(J): 1 - w}, "rank": rank,
                      "relative_error_of_the_rank_cut": round(cut, 5)}  # fmt: skip
    (DST / "train_state.json").write_text(json.dumps(state, indent=1) + "\n")
    print(f"{DST}: rank-{rank} cut, relative error {cut:.4f}")


if __name__ == "__main__":
    torch.set_num_threads(1)  # LAPACK's rounding depends on its threads: one, reproducibly
    main()
