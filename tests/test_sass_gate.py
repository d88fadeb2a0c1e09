""".ci/sass_gate.py on cuobjdump-style text (no CUDA toolkit needed): it finds HGMMA, HMMA and
local memory per function, fails on each violation, says so when it has no Hopper kernel to
check, and catches ptxas's "wgmma serialized" warning. The SASS lines below are cuobjdump 13.2
output for sm_90a probes (an m64n8k16 wgmma, a stack array indexed at run time), trimmed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

GATE = Path(__file__).resolve().parents[1] / ".ci" / "sass_gate.py"

SASS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

	code for sm_90a
	.target	sm_90a

		Function : _Z18probe_local_kernelPKiPf
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
                                                                            /* 0x000fe20000000800 */
        /*0010*/                   STL.128 [R1], R4 ;                       /* 0x0000000401007387 */
        /*0020*/              @!P0 LDL R2, [R1+0x4] ;                       /* 0x0000040001028983 */
        /*0030*/                   EXIT ;                                   /* 0x000000000000794d */
		..........

		Function : _Z18probe_wgmma_kernelmmPf
        /*0000*/                   WARPGROUP.ARRIVE ;                       /* 0x00000000000079c7 */
        /*0060*/                   HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;          /* 0x00000000000079c7 */
        /*0080*/                   EXIT ;                                   /* 0x000000000000794d */

		Function : _Z15ampere_mma_kernelPf
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;    /* 0x0000000c0804723c */
        /*0010*/                   EXIT ;                                   /* 0x000000000000794d */
"""


@pytest.fixture()
def gate(monkeypatch):
    spec = importlib.util.spec_from_file_location("sass_gate", GATE)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sass_gate", mod)  # (its dataclasses look it up)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HOPPER_KERNELS", [])
    monkeypatch.setattr(mod, "OTHER_KERNELS", [])
    return mod


def test_parse_counts_per_function(gate):
    fns = {f.name: f for f in gate.parse_sass(SASS)}
    assert set(fns) == {
        "_Z18probe_local_kernelPKiPf",
        "_Z18probe_wgmma_kernelmmPf",
        "_Z15ampere_mma_kernelPf",
    }
    assert all(f.arch == "sm_90a" for f in fns.values())
    assert fns["_Z18probe_local_kernelPKiPf"].counts == {"HGMMA": 0, "HMMA": 0, "LDL": 1, "STL": 1}
    assert fns["_Z18probe_wgmma_kernelmmPf"].counts["HGMMA"] == 1
    assert fns["_Z15ampere_mma_kernelPf"].counts["HMMA"] == 1
    assert fns["_Z18probe_wgmma_kernelmmPf"].instructions == 4


def test_violations_fail(gate, capsys):
    gate.HOPPER_KERNELS += ["probe_wgmma", "ampere_mma", "probe_local", "not_built"]
    bad = gate.check(gate.parse_sass(SASS), log_text=None, require_hopper=False)
    text = "\n".join(bad)
    assert "probe_local_kernelPKiPf: local memory (LDL 1, STL 1)" in text
    assert "probe_local_kernelPKiPf: a Hopper kernel without HGMMA" in text
    assert "ampere_mma_kernelPf: 1 HMMA" in text
    assert "ampere_mma_kernelPf: a Hopper kernel without HGMMA" in text
    assert "'not_built' (HOPPER_KERNELS) is not in the sm_90a objects" in text
    assert not any("probe_wgmma" in b for b in bad)
    assert "NOTICE" not in capsys.readouterr().out


def test_unlisted_functions_fail(gate):
    gate.HOPPER_KERNELS.append("probe_wgmma")
    bad = gate.check(gate.parse_sass(SASS), log_text=None, require_hopper=False)
    assert sum("not listed in .ci/sass_gate.py" in b for b in bad) == 2


def test_a_clean_object_passes_and_says_what_it_did_not_check(gate, capsys):
    sass = SASS.split("\t\tFunction : _Z18probe_wgmma")[0].replace("STL.128", "STS.128")
    sass = sass.replace("LDL R2", "LDS R2")
    gate.OTHER_KERNELS.append("probe_local")
    assert gate.check(gate.parse_sass(sass), log_text="", require_hopper=False) == []
    out = capsys.readouterr().out
    assert "NOTICE: HGMMA check: HOPPER_KERNELS is empty" in out
    assert "NOTHING WAS CHECKED for HGMMA" in out
    bad = gate.check(gate.parse_sass(sass), log_text=None, require_hopper=True)
    assert len(bad) == 1 and "HOPPER_KERNELS is empty" in bad[0]


def test_wgmma_serialized_warning_and_missing_arch(gate):
    gate.HOPPER_KERNELS.append("probe_wgmma")
    gate.OTHER_KERNELS += ["probe_local", "ampere_mma"]
    log = (
        "ptxas info    : Used 168 registers\n"
        "ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to the presence of Extern calls in the function 'fwd'\n"
    )
    bad = gate.check(gate.parse_sass(SASS), log_text=log, require_hopper=False)
    assert any("ptxas: ptxas warning : (C7510)" in b for b in bad)
    sm80 = SASS.replace("sm_90a", "sm_80")
    assert gate.check(gate.parse_sass(sm80), None, False) == [
        "no sm_90a function in the objects (were they compiled for sm_90a?)"
    ]
