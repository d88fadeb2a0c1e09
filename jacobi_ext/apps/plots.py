"""Figures (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_step_curve(
    curve, path: str | Path, title: str | None = None, floor: list[float] | None = None
) -> Path:
    """Forward latency vs parallel tokens (log x), with the knee marked, and where `floor` is
    given (seconds per curve.sizes: jacobi_ext.tools.roofline.floor_curve) the roofline floor
    as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ms = [1e3 * s for s in curve.seconds]
    ax.plot(curve.sizes, ms, "o-", label="forward")
    if floor is not None:
        from jacobi_ext.tools.roofline import FLOOR_LABEL

        ax.plot(curve.sizes, [1e3 * s for s in floor], "--", color="tab:red", label=FLOOR_LABEL)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("latency (ms)")
    knee = curve.knee()
    ax.axvline(knee, color="gray", ls="--", label=f"knee: {knee} tokens")
    if title is None:
        title = f"{curve.hardware}\n{curve.dtype}, {curve.threads} threads, cache {curve.context}"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
