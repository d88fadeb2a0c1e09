"""attn_implementation="jacobi": a whole tiny Llama / Qwen2 forward + backward on a packed JF
sequence matches the same model with SDPA and the dense mask (logits and parameter grads)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import jacobi_ext  # noqa: F401  (registers "jacobi")
from jacobi_ext import JacobiLayout
from jacobi_ext.hf import jacobi_layout

transformers = pytest.importorskip("transformers")


def tiny_config(kind: str):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


def twin_models(kind: str):
    torch.manual_seed(0)
    cfg = tiny_config(kind)
    # _from_config writes attn_implementation into the config: one deep copy per model.
    ours = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="jacobi"
    )
    ref = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="sdpa"
    )
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "kind,variant,w",
    [("llama", "noisy_context", None), ("llama", "windowed", 2), ("qwen2", "clean_context", None)],
)
def test_packed_forward_backward_matches_sdpa_dense_mask(kind, variant, w):
    ours, ref = twin_models(kind)
    assert ours.config._attn_implementation == "jacobi"
    layout = JacobiLayout(prompt_len=13, block_size=8, num_blocks=4, variant=variant, window=w)
    S = layout.seq_len
    ids = torch.randint(0, 128, (2, S))
    pos = layout.position_ids()[None].expand(2, -1)

    with jacobi_layout(layout):
        logits = ours(input_ids=ids, position_ids=pos).logits
    (logits.float().square().mean()).backward()

    mask = layout.dense_mask()[None, None].expand(2, 1, S, S)  # bool 4-D: used as given
    ref_logits = ref(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    (ref_logits.float().square().mean()).backward()

    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    g, rg = grads(ours), grads(ref)
    assert g.keys() == rg.keys() and len(g) > 10
    for name in g:
        torch.testing.assert_close(g[name], rg[name], rtol=1e-3, atol=1e-5, msg=name)

    # The layout really matters: plain causal attention over the same tokens differs.
    causal = ref(input_ids=ids, position_ids=pos).logits
    assert (causal - ref_logits).abs().max() > 1e-2


def test_layout_keyword_is_equivalent_to_the_context_manager():
    ours, _ = twin_models("llama")
    layout = JacobiLayout(5, 4, 3)
    ids = torch.randint(0, 128, (1, layout.seq_len))
    pos = layout.position_ids()[None]
    with torch.no_grad(), jacobi_layout(layout):
        a = ours(input_ids=ids, position_ids=pos).logits
    with torch.no_grad():
        b = ours(input_ids=ids, position_ids=pos, jacobi_layout=layout).logits
    torch.testing.assert_close(a, b)


def test_without_a_layout_it_is_ordinary_causal_attention():
    ours, ref = twin_models("llama")
    ids = torch.randint(0, 128, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
        # KV-cache decoding (multi-token steps need the registered mask function)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))


def test_layout_length_mismatch_is_a_clear_error():
    ours, _ = twin_models("llama")
    layout = JacobiLayout(5, 4, 3)
    ids = torch.randint(0, 128, (1, layout.seq_len + 1))
    with pytest.raises(ValueError, match="covers one whole packed sequence"), jacobi_layout(layout):
        ours(input_ids=ids)


def test_import_jacobi_ext_alone_registers_without_importing_transformers():
    code = (
        "import sys, jacobi_ext\n"
        "assert 'transformers.modeling_utils' not in sys.modules\n"
        "import transformers\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
        "assert 'jacobi' in ALL_ATTENTION_FUNCTIONS and 'jacobi' in ALL_MASK_ATTENTION_FUNCTIONS\n"
        "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation='jacobi')\n"
        "print(m.config._attn_implementation)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("jacobi")
