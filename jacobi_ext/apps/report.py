"""`jacobi-forcing bench`: run the pytest-benchmark suites in bench/, then render their JSON into
three figures and one Markdown report (medians, ratios, the machine they ran on).

Figures:
  forward_latency.png   forward latency vs parallel tokens, knee marked (bench_verify.py)
  decoding_sweep.png    tokens/s and TPF vs block size for jacobi and multiblock, pool sizes as
                        lines, transformers greedy / prompt lookup as horizontal references
                        (bench_decoding.py)
  attention.png         training attention time vs sequence length, forward and
                        forward+backward, per implementation (bench_attention.py)
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SUITES = ("decoding", "verify", "attention")


def _machine(benches=()) -> dict:
    """This machine, with torch's thread count and version as the benchmark runs recorded them
    (a re-render from another shell must not report its own), several values joined by ' / '."""
    import torch

    from jacobi_ext.decoding.tuning import cpu_name

    def recorded(key, now):
        vals = sorted({str(b[key]) for b in benches if b.get(key) is not None})
        return " / ".join(vals) if vals else now

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch threads": recorded("_threads", torch.get_num_threads()),
        "torch": recorded("_torch", torch.__version__),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


class BenchNotFound(FileNotFoundError):
    """The benchmark suites are not where `jacobi-forcing bench` looked."""


def bench_dir(given: str | Path | None = None) -> Path:
    """The folder of the bench_<suite>.py suites: `given`, else the bench/ of the source checkout
    this package runs from. The suites are not part of the wheel (they are pytest files beside
    the library, not the library), so an installed package needs a checkout's bench/ named."""
    root = Path(given) if given is not None else Path(__file__).resolve().parents[2] / "bench"
    if not (root / "conftest.py").is_file():
        where = "the folder given" if given is not None else "beside this installed package"
        raise BenchNotFound(
            f"no benchmark suites in {root} ({where}): `jacobi-forcing bench` runs the pytest "
            "suites of a source checkout. Run it from a clone of the repository (the editable "
            "install of the README), or pass --bench-dir CLONE/bench; --render-only renders "
            "JSON you already have"
        )
    return root


def run_suites(
    suites, out_dir: Path, quick: bool = False, extra_args=(), env_extra=None, root=None
) -> list[Path]:
    """Run bench_<suite>.py of `root` (default: bench_dir()) for each suite; one JSON per suite
    in out_dir."""
    root = bench_dir(root)
    # Absolute: the suites may change directory, and pytest-benchmark writes the JSON at the end.
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    env = dict(os.environ)
    env.update(env_extra or {})
    if quick:
        env["JACOBI_BENCH_QUICK"] = "1"
    for suite in suites:
        path = out_dir / f"{suite}.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(root / f"bench_{suite}.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "python_files=bench_*.py",
            f"--benchmark-json={path}",
            "--benchmark-columns=median,rounds",
            *extra_args,
        ]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env, cwd=out_dir)
        if rc not in (0, 5):  # 5: nothing collected (e.g. a GPU-only suite on a CPU machine)
            raise RuntimeError(f"benchmark suite {suite} failed (exit {rc})")
        if path.is_file():
            paths.append(path)
    return paths


def load(paths) -> list[dict]:
    benches = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        info = data.get("machine_info", {})
        for b in data.get("benchmarks", []):
            b["_file"] = str(p)
            b["_model"] = info.get("jacobi_bench_model")
            b["_threads"] = info.get("torch_threads")
            b["_torch"] = info.get("torch_version")
            benches.append(b)
    return benches


def _median(b: dict) -> float:
    return float(b["stats"]["median"])


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_forward_latency(benches, path: Path) -> Path | None:
    pts = sorted(
        (b["extra_info"]["tokens"], _median(b), b["extra_info"].get("floor_ms"))
        for b in benches
        if b["name"].startswith("test_forward_latency_vs_tokens")
    )
    if not pts:
        return None
    from jacobi_ext.apps.plots import plot_step_curve
    from jacobi_ext.decoding.tuning import StepCurve

    curve = StepCurve([q for q, _, _ in pts], [s for _, s, _ in pts], 256, "", "", 0, "")
    # The roofline floor the benchmark recorded beside each width (older runs have none).
    floor = [f / 1e3 for _, _, f in pts] if all(f is not None for _, _, f in pts) else None
    return plot_step_curve(
        curve, path, title="forward latency vs parallel tokens (cache of 256)", floor=floor
    )


def figure_sweep(benches, path: Path) -> Path | None:
    sweep = [b for b in benches if b["name"].startswith("test_sweep[")]
    refs = [b for b in benches if b["name"].startswith("test_sweep_reference")]
    if not sweep:
        return None
    lines = defaultdict(list)
    for b in sweep:
        e = b["extra_info"]
        label = e["method"] + (f", pool {e['pool_size']}" if e["method"] == "multiblock" else "")
        label += " + lookup" if e.get("lookup") else ""
        lines[label].append((e["block_size"], e["tokens_per_s"], e["tpf"]))
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, pts in sorted(lines.items()):
        pts.sort()
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    styles = {
        "hf-greedy": ("k", "--"),
        "hf-prompt-lookup": ("k", ":"),
        "tuned": ("tab:purple", "-."),
    }
    for b in refs:
        e = b["extra_info"]
        color, ls = styles.get(e["method"], ("gray", "-"))
        label = "ours, tuned (the default)" if e["method"] == "tuned" else e["method"]
        a1.axhline(e["tokens_per_s"], color=color, ls=ls, label=label)
        if e["method"] == "tuned" and e.get("tpf"):
            a2.axhline(e["tpf"], color=color, ls=ls, label=label)
    a2.axhline(1.0, color="k", ls="--", label="greedy (1 token/forward)")
    for ax, yl in ((a1, "tokens / s"), (a2, "tokens per forward")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size n")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("decoding vs block size (same prompts for every line)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _attention_rows(benches):
    """Rows of bench_attention.py: extra_info impl, mode (fwd | fwdbwd), seq_len, dtype, variant,
    gflops (on the mask's useful FLOPs), peak_extra_mib; plus the matmul reference rate."""
    rows = []
    for b in benches:
        e = b.get("extra_info", {})
        if "seq_len" in e and "impl" in e and "mode" in e:
            rows.append(
                dict(
                    impl=e["impl"],
                    seq_len=e["seq_len"],
                    passes=e["mode"],
                    dtype=e.get("dtype", ""),
                    variant=e.get("variant", ""),
                    median=_median(b),
                    gflops=e.get("gflops"),
                    peak_mb=e.get("peak_extra_mib"),
                )
            )
    return rows


def _matmul_rates(benches) -> dict:
    return {
        b["extra_info"]["dtype"]: b["extra_info"]["gflops"]
        for b in benches
        if b.get("extra_info", {}).get("impl") == "matmul"
    }


def figure_attention(benches, path: Path, dtype="float32", variant="noisy_context") -> Path | None:
    rows = [
        r
        for r in _attention_rows(benches)
        if r["dtype"] in (dtype, "fp32" if dtype == "float32" else dtype)
        and r["variant"] == variant
    ]
    if not rows:
        return None
    plt = _plt()
    passes = sorted({r["passes"] for r in rows})
    fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 4), squeeze=False)
    for ax, ps in zip(axes[0], passes, strict=True):
        by = defaultdict(list)
        for r in rows:
            if r["passes"] == ps:
                by[r["impl"]].append((r["seq_len"], 1e3 * r["median"]))
        for impl, pts in sorted(by.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("time (ms, median)")
        ax.set_title(f"{ps}, {variant}, {dtype}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(x, spec=".1f"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def markdown(benches, machine: dict, figures: dict, compare: dict | None = None) -> str:
    """The report: the machine, then a section per kind of benchmark present, the figures and
    (with a baseline) the comparison."""
    out = ["# jacobi_ext benchmark report", ""]
    out += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine.items()]
    models = sorted({b["_model"] for b in benches if b.get("_model")})
    if models:
        out.append(f"| model | {', '.join(models)} |")
    for section in (_md_decoding, _md_loop, _md_forward, _md_sweep, _md_attention):
        out += section(benches)
    if figures:
        out += ["", "## Figures", ""] + [f"![{k}]({v.name})" for k, v in figures.items()]
    if compare:
        out += _md_compare(compare)
    return "\n".join(out) + "\n"


def _md_decoding(benches) -> list[str]:
    """The decoding table (bench_decoding): tokens/s, TPF and speedup per method."""
    out: list[str] = []
    dec = [b for b in benches if b["name"].startswith("test_decoding[")]
    if dec:
        e0 = dec[0]["extra_info"]
        out += [
            "",
            f"## Decoding ({e0['prompts']} prompts, up to {e0['max_new_tokens']} new "
            "tokens, greedy, batch 1)",
            "",
            "| method | tokens/s | TPF | steady ms/step | prefill ms | speedup vs transformers "
            "greedy | identical to greedy | identical to our ar | device |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in dec:
            e = b["extra_info"]
            ident, same_ar = e.get("identical_to_greedy"), e.get("identical_to_ar")
            out.append(
                f"| {e['method']} | {_fmt(e['tokens_per_s'])} | {_fmt(e.get('tpf'), '.2f')}"
                f" | {_fmt(e.get('steady_ms_per_step'), '.2f')}"
                f" | {_fmt(e.get('prefill_ms'), '.1f')}"
                f" | {_fmt(e.get('speedup_vs_hf_greedy'), '.2f')}x | "
                f"{'-' if ident is None else ('yes' if ident else 'NO')} | "
                f"{'-' if same_ar is None else ('yes' if same_ar else 'NO')} | "
                f"{e.get('device', '-')} |"
            )
        out.append(
            "\nsteady ms/step: the median step after warm-up (prefill and graph captures apart); "
            "tokens/s: whole calls, prefill included."
        )
    return out


def _md_loop(benches) -> list[str]:
    """The decoding loop's host costs: verify_step latency and the loop's share of a step."""
    out: list[str] = []
    ver = [b for b in benches if b["name"] == "test_verify_step_cpu_latency"]
    loop = [b for b in benches if b["name"] == "test_decoding_loop_overhead"]
    if ver or loop:
        out += ["", "## Decoding loop", ""]
        if ver:
            out.append(
                f"- verify_step (n=64, K=2, pool 4): **{1e6 * _median(ver[0]):.1f} us** "
                "median per call (target <= 20 us)"
            )
        if loop:
            e = loop[0]["extra_info"]
            out.append(
                f"- host loop outside the model forward: **{100 * e['loop_share']:.1f}%** "
                f"of step time ({e['per_step_overhead_ms']:.2f} ms per step; target <= 5%)"
            )
    return out


def _md_forward(benches) -> list[str]:
    """Forward latency vs parallel tokens, against the roofline floor the run recorded."""
    out: list[str] = []
    fwd_b = sorted(
        (b for b in benches if b["name"].startswith("test_forward_latency_vs_tokens")),
        key=lambda b: b["extra_info"]["tokens"],
    )
    fwd = [(b["extra_info"]["tokens"], _median(b)) for b in fwd_b]
    if fwd:
        out += [
            "",
            "## Forward latency vs parallel tokens",
            "",
            "| tokens | " + " | ".join(str(q) for q, _ in fwd) + " |",
            "|---|" + "---|" * len(fwd),
            "| ms | " + " | ".join(f"{1e3 * s:.1f}" for _, s in fwd) + " |",
            "| x one token | " + " | ".join(f"{s / fwd[0][1]:.2f}" for _, s in fwd) + " |",
        ]
        floors = [b["extra_info"].get("floor_ms") for b in fwd_b]
        if all(f is not None for f in floors):  # the roofline the benchmark recorded
            e = fwd_b[0]["extra_info"]
            out += [
                "| floor ms | " + " | ".join(f"{f:.1f}" for f in floors) + " |",
                "| x floor | "
                + " | ".join(f"{1e3 * s / f:.2f}" for (_, s), f in zip(fwd, floors, strict=True))
                + " |",
                "",
                f"Floor t_min(q) = max(weight bytes / read bandwidth, FLOPs(q) / compute peak): "
                f"{e['weight_bytes'] / 1e6:.1f} MB of weights, read {e['read_gbps']:.1f} GB/s, "
                f"peak {e['peak_gflops']:.0f} GFLOP/s (this machine, as the run recorded them).",
            ]
    return out


def _md_sweep(benches) -> list[str]:
    """The decoding sweep over block sizes, against the reference rows of the same run."""
    out: list[str] = []
    sweep = [b for b in benches if b["name"].startswith("test_sweep[")]
    if sweep:
        refs = {
            b["extra_info"]["method"]: b["extra_info"]["tokens_per_s"]
            for b in benches
            if b["name"].startswith("test_sweep_reference")
        }
        greedy = refs.get("hf-greedy")
        out += [
            "",
            "## Decoding vs block size",
            "",
            "Same prompts for every row; "
            + ", ".join(f"{m} {_fmt(v)} tokens/s" for m, v in sorted(refs.items()))
            + (" (the references)." if refs else "no reference rows in this run."),
            "",
            "| method | n | pool | lookup | tokens/s | TPF | vs transformers greedy |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in sorted(
            sweep,
            key=lambda b: (
                b["extra_info"]["method"],
                b["extra_info"].get("lookup", False),
                b["extra_info"]["pool_size"],
                b["extra_info"]["block_size"],
            ),
        ):
            e = b["extra_info"]
            out.append(
                f"| {e['method']} | {e['block_size']} | {e['pool_size']} | "
                f"{'yes' if e.get('lookup') else 'no'} | "
                f"{_fmt(e['tokens_per_s'])} | {_fmt(e['tpf'], '.2f')} | "
                + (f"{e['tokens_per_s'] / greedy:.2f}x |" if greedy else "- |")
            )
    return out


def _md_attention(benches) -> list[str]:
    """The training attention table: ours against the other implementations."""
    out: list[str] = []
    att = _attention_rows(benches)
    if att:
        mm = _matmul_rates(benches)
        out += ["", "## Training attention (B=1, Hq=9, Hkv=3, D=64, P=256, n=32)", ""]
        if mm:
            rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in sorted(mm.items()))
            out += [
                f"matmul in the same run: {rates}. Targets (fp32, S=4096, fwd+bwd): >= 3.5x "
                "dense SDPA, >= 1.3x two-pass, >= 50% of matmul on useful FLOPs.",
                "",
            ]
        out += [
            "| variant | dtype | pass | S | impl | ms | GFLOP/s (useful) | peak extra MiB "
            "| its time / ours | ours, % of matmul |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        ours = {
            (r["variant"], r["dtype"], r["passes"], r["seq_len"]): r
            for r in att
            if r["impl"] == "jacobi"
        }
        for r in sorted(
            att,
            key=lambda r: (
                r["variant"],
                r["dtype"],
                r["passes"],
                r["seq_len"],
                r["impl"] != "jacobi",
                r["impl"],
            ),
        ):
            o = ours.get((r["variant"], r["dtype"], r["passes"], r["seq_len"]))
            ratio = f"{r['median'] / o['median']:.2f}x" if o is not None and r is not o else "-"
            pct = (
                f"{100 * r['gflops'] / mm[r['dtype']]:.0f}%"
                if r is o and r["gflops"] and r["dtype"] in mm
                else "-"
            )
            out.append(
                f"| {r['variant']} | {r['dtype']} | {r['passes']} | {r['seq_len']} | "
                f"{r['impl']} | {1e3 * r['median']:.1f} | {_fmt(r['gflops'])} | "
                f"{_fmt(r['peak_mb'])} | {ratio} | {pct} |"
            )
    return out


def _md_compare(compare) -> list[str]:
    """Each benchmark's median against the baseline run's (regressions flagged)."""
    out: list[str] = []
    if compare:
        out += [
            "",
            "## Against the baseline",
            "",
            "| benchmark | baseline ms | now ms | ratio | |",
            "|---|---|---|---|---|",
        ]
        for name, (old, new) in sorted(compare.items()):
            ratio = new / old
            flag = "REGRESSION" if ratio > 1.10 else ("faster" if ratio < 0.90 else "")
            out.append(f"| {name} | {1e3 * old:.2f} | {1e3 * new:.2f} | {ratio:.2f} | {flag} |")
    return out


def compare_runs(benches, baseline_paths) -> dict:
    base = {b["fullname"]: _median(b) for b in load(baseline_paths)}
    return {
        b["fullname"]: (base[b["fullname"]], _median(b)) for b in benches if b["fullname"] in base
    }


def render(paths, out_dir: Path, baseline=None) -> Path:
    benches = load(paths)
    figures = {}
    for name, fn in (
        ("forward latency", figure_forward_latency),
        ("decoding sweep", figure_sweep),
        ("attention", figure_attention),
    ):
        fname = name.replace(" ", "_") + ".png"
        p = fn(benches, out_dir / fname)
        if p is not None:
            figures[name] = p
    cmp = compare_runs(benches, baseline) if baseline else None
    report = out_dir / "REPORT.md"
    report.write_text(markdown(benches, _machine(benches), figures, cmp))
    return report


def cmd_bench(args) -> int:
    out_dir = Path(args.out)
    if args.render_only:
        paths = sorted(out_dir.glob("*.json"))
        if not paths:
            raise FileNotFoundError(f"no benchmark JSON in {out_dir} to render")
    else:
        suites = args.suites or list(SUITES)
        unknown = set(suites) - set(SUITES) - {"attention_cuda", "sampling"}
        if unknown:
            raise ValueError(f"unknown suite(s) {sorted(unknown)}; choose from {SUITES}")
        try:
            root = bench_dir(getattr(args, "bench_dir", None))
        except BenchNotFound as exc:
            print(f"jacobi-forcing bench: {exc}", file=sys.stderr)
            return 2
        paths = run_suites(
            suites,
            out_dir,
            root=root,
            quick=args.quick,
            extra_args=["-k", args.k] if args.k else [],
            env_extra={
                var: str(getattr(args, opt))
                for opt, var in (
                    ("device", "JACOBI_BENCH_DEVICE"),
                    ("dtype", "JACOBI_BENCH_DTYPE"),
                    ("batch", "JACOBI_BENCH_BATCH"),
                )
                if getattr(args, opt, None)
            },
        )
    report = render(paths, out_dir, baseline=args.compare)
    print(f"report: {report}")
    print(report.read_text())
    return 0
