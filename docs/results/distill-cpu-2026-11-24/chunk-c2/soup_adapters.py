"""Two chunk C2 arms averaged in weight space: w · lr3 + (1 − w) · kl2, as one rank-16 LoRA adapter.

Both arms start from chunk B and saw the same data in the same order; they differ only in the KL
to the base (μ = 0 for lr3, 2 for kl2). Averaging their updates is a cheap stand-in for the μ in
between. Each module's update w·B₁A₁ + (1 − w)·B₂A₂ has rank ≤ 32; it is cut back to its best
rank-16 approximation (QR of the stacked factors, then an SVD of the 32 × 32 core) so that the
result has the shipped adapter's size. The relative Frobenius error of that cut is printed.

The inputs are the two arms' adapters under runs/chunkC2/ (kl2 is in git at 65aa0c9,
jacobi_ext/adapters/smollm2-jf; lr3 was never committed, the repo holds one adapter: remake it
with the command in ../README.md, "Chunk C2", without --kl-weight).

    python docs/results/distill-cpu-2026-11-24/chunk-c2/soup_adapters.py 0.5   # runs/soup/w0.5
    jacobi-forcing fidelity --model runs/soup/w0.5 --threads 1 \
        --reference docs/results/eval-cpu-2026-11-26/base-humaneval-164.jsonl --out soup.json
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LR3, KL2 = Path("runs/chunkC2/lr3/adapter"), Path("runs/chunkC2/kl2/adapter")


def best_rank(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``rank`` factors (B', A') of the product b @ a, b: [out, R], a: [R, in]."""
    qb, rb = torch.linalg.qr(b.double())
    qa, ra = torch.linalg.qr(a.double().T)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    root = s[:rank].sqrt()
    return ((qb @ u[:, :rank]) * root).float(), (root[:, None] * (vh[:rank] @ qa.T)).float()


def soup(w: float, rank: int = 16) -> Path:
    x, y = (load_file(d / "adapter_model.safetensors") for d in (LR3, KL2))
    out, err, norm = {}, 0.0, 0.0
    for ka in (k for k in x if "lora_A" in k):
        kb = ka.replace("lora_A", "lora_B")
        b = torch.cat([w * x[kb], (1 - w) * y[kb]], dim=1)
        a = torch.cat([x[ka], y[ka]], dim=0)
        out[kb], out[ka] = best_rank(b, a, rank)
        full = b.double() @ a.double()
        err += (full - out[kb].double() @ out[ka].double()).square().sum().item()
        norm += full.square().sum().item()
    dst = Path(f"runs/soup/w{w}")
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(KL2 / "adapter_config.json", dst)
    save_file(out, dst / "adapter_model.safetensors")
    cut = (err / norm) ** 0.5
    # Both arms ran the same steps over the same data: kl2's state (step, tokens, settings)
    # stands for the pair, with the merge said beside it.
    state = json.loads((KL2 / "train_state.json").read_text())
    state["merge"] = {
        "of": {str(LR3): w, str(KL2): 1 - w},
        "rank": rank,
        "relative_error_of_the_rank_cut": round(cut, 5),
        "note": "w * lr3 + (1 - w) * kl2 LoRA updates (lr3: kl_weight 0), cut to rank 16; "
        "made by docs/results/distill-cpu-2026-11-24/chunk-c2/soup_adapters.py",
    }
    (dst / "train_state.json").write_text(json.dumps(state, indent=1) + "\n")
    print(f"{dst}: rank-{rank} cut, relative error {cut:.4f}")
    return dst


if __name__ == "__main__":
    torch.set_num_threads(1)  # LAPACK's rounding depends on its threads: one, reproducibly
    for w in map(float, sys.argv[1:]):
        soup(w)
