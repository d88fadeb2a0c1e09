"""The roofline of a decoding forward: the model's bytes and FLOPs, the floor, the
machine's ceilings (measured once, cached), and what `jacobi-forcing tune` and the plot show."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import matplotlib
import pytest
import torch

from jacobi_ext.decoding import tuning
from jacobi_ext.models import tiny_llama
from jacobi_ext.tools import roofline

matplotlib.use("Agg")

HAND = roofline.Machine(
    read_gbps=10.0, peak_gflops=100.0, dtype="torch.float32", threads=2, hardware="t", device="cpu"
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path / "cache"))


@pytest.fixture()
def fake_measure(monkeypatch):
    """measure_machine replaced by a counter that returns HAND (in the asked-for dtype)."""
    calls = []

    def measure(device="cpu", dtype=torch.float32):
        calls.append((str(device), dtype))
        return roofline.Machine(**{**HAND.__dict__, "dtype": str(dtype)})

    monkeypatch.setattr(roofline, "measure_machine", measure)
    return calls


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_weight_bytes_skip_an_untied_input_embedding() -> None:
    model = tiny_llama(vocab_size=96, hidden_size=64, seed=0)
    emb = model.get_input_embeddings().weight
    assert emb.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    c = roofline.model_cost(model)
    # Every parameter once, except the input table (gathered a row per token, never streamed).
    assert c.weight_bytes == _bytes(model.parameters()) - _bytes([emb])
    assert c.weight_bytes > 0


def test_weight_bytes_count_a_tied_head_once() -> None:
    model = tiny_llama(vocab_size=96, hidden_size=64, seed=0)
    emb = model.get_input_embeddings().weight
    # Tied by sharing storage under two Parameter objects: only data_ptr tells them apart.
    model.lm_head.weight = torch.nn.Parameter(emb.data)
    params = list(model.parameters())
    assert sum(p.data_ptr() == emb.data_ptr() for p in params) == 2
    c = roofline.model_cost(model)
    assert c.weight_bytes == _bytes(params) - _bytes([emb])  # counted once, not 0 or 2 times
    # The plain tie (one Parameter) gives the same figure.
    model.lm_head.weight = emb
    assert roofline.model_cost(model).weight_bytes == c.weight_bytes


def test_linear_params_shapes_and_flops() -> None:
    V, H, L, heads, kv = 96, 64, 2, 4, 2
    model = tiny_llama(vocab_size=V, hidden_size=H, num_layers=L, num_heads=heads, num_kv_heads=kv)
    c = roofline.model_cost(model)
    hd = H // heads
    per_layer = 2 * H * H + 2 * H * kv * hd + 3 * H * 2 * H  # q, o; k, v; gate, up, down
    assert c.linear_params == L * per_layer + V * H  # the LM head too
    assert (c.layers, c.q_heads, c.head_dim) == (L, heads, hd)
    for q, ctx in ((1, 0), (16, 256), (64, 100)):
        assert c.flops(q, ctx) == 2 * c.linear_params * q + 4 * L * heads * hd * q * (ctx + q)
    model.lm_head.weight = model.get_input_embeddings().weight  # a tied head still multiplies
    assert roofline.model_cost(model).linear_params == c.linear_params


def test_floor_is_the_larger_of_reading_and_computing() -> None:
    c = roofline.ModelCost(weight_bytes=10**9, linear_params=10**8, layers=0, q_heads=0,
                           head_dim=0)  # fmt: skip
    read = 10**9 / 10e9  # 0.1 s at 10 GB/s
    assert roofline.floor_seconds(HAND, c, 1, 256) == pytest.approx(read)
    assert roofline.floor_seconds(HAND, c, 40, 256) == pytest.approx(read)  # 0.08 s of FLOPs
    assert roofline.floor_seconds(HAND, c, 100, 256) == pytest.approx(2e8 * 100 / 100e9)
    # The attention term counts too.
    c2 = roofline.ModelCost(10**9, 10**8, layers=30, q_heads=9, head_dim=64)
    assert roofline.floor_seconds(HAND, c2, 100, 4096) == pytest.approx(c2.flops(100, 4096) / 100e9)


def test_roofline_rows_beside_a_curve() -> None:
    curve = tuning.StepCurve([1, 4, 16, 64, 128], [0.2, 0.2, 0.3, 0.9, 1.5], 256, "cpu",
                             "torch.float32", 2, "t")  # fmt: skip
    c = roofline.ModelCost(10**9, 10**8, 0, 0, 0)
    rows = roofline.roofline_rows(curve, HAND, c)
    assert [r[0] for r in rows] == list(roofline.ROOFLINE_SIZES)
    for q, ms, floor_ms, ratio in rows:
        assert ms == pytest.approx(1e3 * curve.time(q))
        assert floor_ms == pytest.approx(1e3 * roofline.floor_seconds(HAND, c, q, 256))
        assert ratio == pytest.approx(ms / floor_ms)
    assert rows[0][1:] == pytest.approx((200.0, 100.0, 2.0))
    # Never extrapolated past the curve's last width; any sizes on request.
    short = tuning.StepCurve([1, 4, 16], [0.2, 0.2, 0.3], 256, "cpu", "torch.float32", 2, "t")
    assert [r[0] for r in roofline.roofline_rows(short, HAND, c)] == [1, 2, 4, 8, 16]
    assert [r[0] for r in roofline.roofline_rows(curve, HAND, c, sizes=curve.sizes)] == [
        1, 4, 16, 64, 128,
    ]  # fmt: skip
    floor = roofline.floor_curve(HAND, c, curve)
    assert floor == [roofline.floor_seconds(HAND, c, q, 256) for q in curve.sizes]


def test_machine_is_measured_once_and_cached(fake_measure, tmp_path, monkeypatch) -> None:
    m1 = roofline.machine("cpu", torch.float32)
    m2 = roofline.machine("cpu", torch.float32)
    assert m1 == m2 and len(fake_measure) == 1
    files = list((tmp_path / "cache" / "machine").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["read_gbps"] == 10.0
    roofline._MEMO.clear()  # another process: read back from the file
    assert roofline.machine("cpu", torch.float32) == m1 and len(fake_measure) == 1
    # Another dtype is another entry; remeasure measures again.
    assert roofline.machine("cpu", torch.bfloat16).dtype == "torch.bfloat16"
    assert len(fake_measure) == 2
    roofline.machine("cpu", torch.float32, remeasure=True)
    assert len(fake_measure) == 3
    # The cache lives where JACOBI_EXT_CACHE says.
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path / "elsewhere"))
    roofline.machine("cpu", torch.float32)
    assert len(fake_measure) == 4
    assert len(list((tmp_path / "elsewhere" / "machine").glob("*.json"))) == 1
    # A broken file is measured again, not an error.
    files[0].write_text("{not json")
    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path / "cache"))
    roofline._MEMO.clear()
    assert roofline.machine("cpu", torch.float32) == m1 and len(fake_measure) == 5


def test_machine_measures_this_cpu() -> None:
    m = roofline.measure_machine("cpu", torch.float32)
    assert m.read_gbps > 0.1 and m.peak_gflops > 0.1
    assert (m.dtype, m.device, m.threads) == ("torch.float32", "cpu", torch.get_num_threads())
    assert m.hardware == tuning.cpu_name()
    assert "GB/s" in m.describe() and "GFLOP/s" in m.describe()


def test_plot_draws_the_floor(tmp_path, monkeypatch) -> None:
    import matplotlib.figure

    from jacobi_ext.apps.plots import plot_step_curve

    captured = []
    real = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        captured.append(fig)
        return real(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    curve = tuning.StepCurve([1, 4, 16], [0.02, 0.021, 0.03], 256, "cpu", "torch.float32", 2, "t")
    plot_step_curve(curve, tmp_path / "a.png", floor=[0.01, 0.01, 0.015])
    ax = captured[-1].axes[0]
    floor = next(line for line in ax.lines if line.get_label() == roofline.FLOOR_LABEL)
    assert floor.get_linestyle() == "--"
    assert list(floor.get_ydata()) == pytest.approx([10.0, 10.0, 15.0])
    plot_step_curve(curve, tmp_path / "b.png")  # without a floor: no such line
    assert all(line.get_label() != roofline.FLOOR_LABEL for line in captured[-1].axes[0].lines)


def test_tune_prints_the_roofline(fake_measure, capsys, monkeypatch) -> None:
    from jacobi_ext.apps import cli

    model = tiny_llama(vocab_size=96, hidden_size=64, seed=0)
    curve = tuning.StepCurve([1, 2, 4], [0.010, 0.011, 0.012], 256, "cpu", "torch.float32", 2,
                             "t")  # fmt: skip
    monkeypatch.setattr(cli, "_load", lambda args: (model, None))
    monkeypatch.setattr(tuning, "step_curve", lambda *a, **k: curve)
    working = {}  # the floor's bandwidth: that of a working set of the weights' bytes

    def for_working_set(m, nbytes):
        working["bytes"] = nbytes
        return dataclasses.replace(m, read_gbps=20.0)

    monkeypatch.setattr(roofline, "for_working_set", for_working_set)
    monkeypatch.setenv("COLUMNS", "160")
    assert cli.main(["tune"]) == 0
    out = capsys.readouterr().out
    assert working["bytes"] == roofline.model_cost(model).weight_bytes
    assert "read bandwidth 20.0 GB/s" in out and "compute peak 100 GFLOP/s" in out
    assert "float32" in out and "2 threads" in out
    mb = roofline.model_cost(model).weight_bytes / 1e6
    assert f"{mb:.1f} MB of weights" in out
    assert "floor ms" in out and "x floor" in out
    c = roofline.model_cost(model)
    for q, s in zip(curve.sizes, curve.seconds, strict=True):
        f = roofline.floor_seconds(dataclasses.replace(HAND, read_gbps=20.0), c, q, 256)
        row = next(line for line in out.splitlines() if line.strip("│ ").startswith(f"{q} "))
        assert f"{1e3 * f:.1f}" in row and f"{s / f:.2f}" in row
    assert len(fake_measure) == 1
    assert math.isfinite(mb)


def test_report_table_and_plot_carry_the_floor(tmp_path) -> None:
    from jacobi_ext.apps import report

    benches = []
    for q, s in ((1, 0.010), (2, 0.011), (4, 0.012)):
        extra = dict(tokens=q, read_gbps=10.0, peak_gflops=100.0, weight_bytes=50_000_000,
                     floor_ms=5.0, x_floor=1e3 * s / 5.0)  # fmt: skip
        benches.append({
            "name": f"test_forward_latency_vs_tokens[{q}]", "stats": {"median": s},
            "extra_info": extra,
        })  # fmt: skip
    data = {"machine_info": {}, "benchmarks": benches}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    text = report.markdown(report.load([path]), {}, {})
    assert "| floor ms | 5.0 | 5.0 | 5.0 |" in text
    assert "| x floor | 2.00 | 2.20 | 2.40 |" in text
    assert "50.0 MB of weights" in text
    assert report.figure_forward_latency(report.load([path]), tmp_path / "f.png").is_file()
    assert Path(tmp_path / "f.png").stat().st_size > 0


def test_the_floor_reads_at_the_pace_of_a_working_set_of_the_weights_size() -> None:
    """for_working_set measures the read bandwidth of as many bytes as the weights, read over and
    over (a cache that holds them is faster than memory), and the floor follows it; a GPU
    machine is kept as it is."""
    nbytes = 8 * 2**20
    m = roofline.for_working_set(HAND, nbytes)
    assert m.read_gbps > 0.1 and m.peak_gflops == HAND.peak_gflops and HAND.read_gbps == 10.0
    cost = roofline.ModelCost(nbytes, 1, 1, 1, 1)
    assert roofline.floor_seconds(m, cost, 1, 0) == pytest.approx(nbytes / (m.read_gbps * 1e9))
    gpu = roofline.Machine(**{**HAND.__dict__, "device": "cuda:0"})
    assert roofline.for_working_set(gpu, nbytes) is gpu
