"""The CPU greedy pick (`argmax`) against torch.max(-1).indices, the choice the decoding made
before: the first NaN, else the first of tied maxima, on random shapes, dtypes, ties, NaN and
infinities, at 1 and 2 threads, and on every vector ISA's variant (float rows run a vectorised
kernel compiled per ISA; float64 rows a scalar walk). And torch.library's checks of the CPU step's
native ops (this one, cpu_step_mask, ar_accept)."""

import pytest
import torch
from conftest import ISAS

from jacobi_ext.decoding.runtime import targets
from jacobi_ext.kernels._native import ops


def _reference(x: torch.Tensor) -> torch.Tensor:
    return x.max(-1).indices


@pytest.fixture(params=[1, 2])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (7,), (4095,), (4097,), (3, 49152), (2, 5, 9000)])
def test_argmax_is_torch_max_index(shape, dtype, threads):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    assert torch.equal(ops.argmax(x), _reference(x))
    # ties: few distinct values, so maxima repeat inside and across chunks
    t = torch.randint(0, 3, shape, generator=g).to(dtype)
    assert torch.equal(ops.argmax(t), _reference(t))


def test_nan_and_infinities(threads):
    x = torch.randn(6, 10000)
    x[0, 9000] = float("nan")  # a NaN in a late chunk beats a larger value in an early one
    x[0, 10] = 1e30
    x[1, 3] = float("nan")
    x[1, 8000] = float("nan")
    x[2] = float("-inf")
    x[3, 5000] = float("inf")
    x[3, 9999] = float("inf")
    x[4, 4096] = 50.0  # the first element of the second chunk
    x[5, 4095] = 50.0  # the last element of the first chunk
    x[5, 4096] = 50.0
    got = ops.argmax(x)
    assert got.tolist() == [9000, 3, 0, 5000, 4096, 4095]
    assert torch.equal(got, _reference(x))


def check_edges() -> None:
    """Every position of the maximum, a NaN and -0 / +0 ties around the vector widths (8 and 16
    lanes, 4 accumulators: 64 values a block) and the scalar tail after them."""
    for n in (1, 5, 15, 16, 17, 63, 64, 65, 127, 128, 130, 1000):
        g = torch.Generator().manual_seed(n)
        for at in sorted({0, n // 2, n - 1, min(n - 1, 63), min(n - 1, 64)}):
            x = torch.randn(n, generator=g)
            x[at] = 10.0
            assert ops.argmax(x).item() == at, (n, at)
            y = x.clone()
            y[at] = float("nan")
            y[n - 1] = float("nan")  # a later NaN never wins
            assert ops.argmax(y).item() == at, (n, at)
            z = torch.full((n,), -1.0)
            z[at:] = 0.0
            z[at::2] = -0.0  # -0 and +0 tie: the first of them
            assert ops.argmax(z).item() == at, (n, at)
        inf = torch.full((n,), float("-inf"))
        assert ops.argmax(inf).item() == 0


def test_edges(threads):
    check_edges()


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, in_isa_process):
    """The float kernel of each ISA variant (capped to what the CPU has), in a process of its own:
    the edge cases and random rows against torch."""
    in_isa_process(
        isa,
        "import torch\n"
        "from test_cpu_argmax import check_edges, ops\n"
        "check_edges()\n"
        "x = torch.randint(0, 3, (5, 49152), generator=torch.Generator().manual_seed(1)).float()\n"
        "assert torch.equal(ops.argmax(x), x.max(-1).indices)\n",
    )


def test_strided_input_and_targets():
    x = torch.randn(4, 3, 5000).transpose(0, 1)  # not contiguous
    assert torch.equal(ops.argmax(x), _reference(x))
    assert torch.equal(targets(x), _reference(x))


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="floating point"):
        ops.argmax(torch.arange(5))
    with pytest.raises(ValueError, match="vocab >= 1"):
        ops.argmax(torch.empty(3, 0))
    assert ops.argmax(torch.empty(0, 5)).shape == (0,)


def test_opcheck():
    """Schema, fake kernel and dispatch as torch.library checks them (a traced step needs them)."""
    torch.library.opcheck(torch.ops.jacobi_ext.argmax.default, (torch.randn(2, 3, 5000),))
    seg = torch.tensor([[0, 0, 1, -1]])
    off = torch.tensor([[0, 1, 0, 0]])
    lo, hi = torch.tensor([4]), torch.tensor([9])
    torch.library.opcheck(torch.ops.jacobi_ext.cpu_step_mask.default, (seg, off, lo, hi, 12))
    toks, tgt = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[4, 5, 1, 2]])
    args = (toks, tgt, torch.tensor([3]), torch.tensor([2]), 6, 3)
    torch.library.opcheck(torch.ops.jacobi_ext.ar_accept.default, args)
