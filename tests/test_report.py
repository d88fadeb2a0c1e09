"""The benchmark report and figures, rendered from stored sample pytest-benchmark JSON (a quick
run on a tiny model), checked for content: axes, series, values, no NaN."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402

from jacobi_ext.apps import report  # noqa: E402

DATA = Path(__file__).parent / "data"


@pytest.fixture()
def sample(tmp_path: Path) -> list[Path]:
    paths = []
    for p in sorted(DATA.glob("bench_sample_*.json")):
        shutil.copy(p, tmp_path / p.name)
        paths.append(tmp_path / p.name)
    return paths


def test_figures_have_the_expected_series(sample, tmp_path, monkeypatch) -> None:
    benches = report.load(sample)
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        captured[Path(path).name] = fig
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    fwd = report.figure_forward_latency(benches, tmp_path / "fwd.png")
    sweep = report.figure_sweep(benches, tmp_path / "sweep.png")
    assert fwd and sweep
    ax = captured["fwd.png"].axes[0]
    assert ax.get_xscale() == "log" and "tokens" in ax.get_xlabel()
    xs = ax.lines[0].get_xdata()
    assert list(xs) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(math.isfinite(y) and y > 0 for y in ax.lines[0].get_ydata())
    assert any("knee" in t.get_text() for t in ax.get_legend().get_texts())
    tps_ax, tpf_ax = captured["sweep.png"].axes
    labels = {t.get_text() for t in tps_ax.get_legend().get_texts()}
    assert {
        "jacobi",
        "multiblock, pool 0",
        "multiblock, pool 4",
        "hf-greedy",
        "hf-prompt-lookup",
    } <= labels
    for line in tps_ax.lines + tpf_ax.lines:
        assert all(math.isfinite(float(v)) for v in line.get_ydata())
    jacobi = next(line for line in tpf_ax.lines if line.get_label() == "jacobi")
    assert list(jacobi.get_xdata()) == [4, 8, 16, 32, 64]
    assert all(v >= 1.0 for v in jacobi.get_ydata())  # TPF is at least one token per forward
    for p in (fwd, sweep):
        img = mpimg.imread(p)
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0.01  # not blank


def test_markdown_report_tables(sample, tmp_path) -> None:
    path = report.render(sample, tmp_path)
    text = path.read_text()
    assert "| method | tokens/s | TPF |" in text
    for m in ("hf-greedy", "hf-prompt-lookup", "| ar |", "jacobi", "multiblock"):
        assert m in text
    assert "verify_step (n=64, K=2, pool 4)" in text and "us** median" in text
    assert "| tokens | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 256 |" in text
    assert "nan" not in text.lower()
    # The block-size sweep table: one row per swept setting, each with its ratio to the sweep's
    # own transformers-greedy reference (not the main decoding table's, which used other prompts).
    sweep_rows = [
        ln
        for ln in text.splitlines()
        if ln.startswith(("| jacobi | ", "| multiblock | ")) and ln.count("|") == 8
    ]
    assert len(sweep_rows) == 15
    benches = {b["name"]: b["extra_info"] for b in report.load(sample)}
    greedy = benches["test_sweep_reference[hf-greedy]"]["tokens_per_s"]
    e = benches["test_sweep[multiblock-n16-p4]"]
    row = f"| multiblock | 16 | 4 | no | {e['tokens_per_s']:.1f} | {e['tpf']:.2f} | "
    assert row + f"{e['tokens_per_s'] / greedy:.2f}x |" in text
    assert "![forward latency](forward_latency.png)" in text
    assert (tmp_path / "forward_latency.png").is_file()


def test_compare_flags_regressions(sample, tmp_path) -> None:
    benches = report.load(sample)
    slow = []
    for b in benches:
        b2 = {**b, "stats": {**b["stats"], "median": b["stats"]["median"] * 1.5}}
        slow.append(b2)
    import json

    base = tmp_path / "base.json"
    base.write_text(json.dumps({"benchmarks": benches}))
    cmp = report.compare_runs(slow, [base])
    assert cmp and all(new / old == pytest.approx(1.5) for old, new in cmp.values())
    md = report.markdown(slow, {"cpu": "x"}, {}, cmp)
    assert "REGRESSION" in md


def test_machine_block_uses_what_the_run_recorded(sample, tmp_path) -> None:
    """A re-render (another shell, other threads) reports the threads, torch and model the
    benchmarks ran with, not its own."""
    import json

    data = json.loads(open(sample[0]).read())
    data["machine_info"] = dict(
        torch_threads=7, torch_version="9.9.9", jacobi_bench_model="runs/x/final"
    )
    path = tmp_path / "recorded.json"
    path.write_text(json.dumps(data))
    text = report.render([path], tmp_path).read_text()
    assert "| torch threads | 7 |" in text and "| torch | 9.9.9 |" in text
    assert "| model | runs/x/final |" in text


def test_bench_says_where_the_suites_are_missing(tmp_path, capsys) -> None:
    """From an installed wheel (no bench/ beside the package) the command says what to do."""
    from jacobi_ext.apps.cli import main

    rc = main(["bench", "--out", str(tmp_path / "out"), "--bench-dir", str(tmp_path / "nope")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no benchmark suites in" in err and "--bench-dir" in err
    checkout = Path(__file__).resolve().parent.parent / "bench"
    assert report.bench_dir(checkout) == checkout  # a clone's suites, named, are found
    beside = Path(report.__file__).resolve().parents[2] / "bench"
    if (beside / "conftest.py").is_file():  # the editable install: found without naming them
        assert report.bench_dir() == beside
    else:  # an installed wheel (as CI runs): the default says so
        with pytest.raises(report.BenchNotFound, match="beside this installed package"):
            report.bench_dir()
