"""The Jacobi Forcing objective (docs/method.md §3): λ·AR + progressive consistency, from ONE
forward of the packed sequence with ``attn_implementation="jacobi"``.

Only the logits the loss reads are computed: transformers' ``logits_to_keep`` takes an index
tensor, so the LM head runs on the AR positions and the consistency positions only (the noisy
positions before f_j, and everything after EOS, never reach the vocabulary projection). The
soft cross-entropy is evaluated in row chunks under activation checkpointing, so the [rows, V]
softmax / log-softmax temporaries exist for one chunk at a time, in the forward and backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from jacobi_ext.hf import jacobi_layout
from jacobi_ext.kernels.layout import JacobiLayout

from .packing import IGNORE, PackedExample

CHUNK_ROWS = 1024  # rows of [rows, vocab] per soft-CE chunk
CONSISTENCY_REDUCTIONS = ("mean_div_T", "mean")


@dataclass
class LossParts:
    total: torch.Tensor  # λ·AR + consistency, differentiable
    ar: float
    consistency: float
    ar_tokens: int
    cons_tokens: int
    kl: float = 0.0  # KL(base || model) per AR position; 0 when kl_weight is 0


def _soft_ce_sum(noisy: torch.Tensor, clean: torch.Tensor, temperature: float) -> torch.Tensor:
    """Σ_rows −Σ_v softmax(clean/τ) · log_softmax(noisy/τ), in float32."""
    p = F.softmax(clean.float() / temperature, dim=-1)
    logq = F.log_softmax(noisy.float() / temperature, dim=-1)
    return -(p * logq).sum()


def soft_cross_entropy(
    noisy: torch.Tensor, clean: torch.Tensor, temperature: float = 1.0, chunk: int = CHUNK_ROWS
) -> torch.Tensor:
    """Summed soft CE of ``noisy`` logits against ``clean`` logits ([rows, V] each; the caller
    detaches ``clean``), evaluated chunk by chunk."""
    total = noisy.new_zeros((), dtype=torch.float32)
    for s in range(0, noisy.shape[0], chunk):
        a, b = noisy[s : s + chunk], clean[s : s + chunk]
        if torch.is_grad_enabled() and a.requires_grad:
            total = total + checkpoint(_soft_ce_sum, a, b, temperature, use_reentrant=False)
        else:
            total = total + _soft_ce_sum(a, b, temperature)
    return total


@contextlib.contextmanager
def adapter_disabled(model):
    """The frozen base model inside a peft LoRA model (its adapter switched off), for the KL
    term: no second copy of the weights is needed."""
    peft_model = getattr(model, "module", model)  # under DDP, accelerate wraps it
    if not hasattr(peft_model, "disable_adapter"):
        raise ValueError(
            "the KL-to-base term (kl_weight > 0, --kl-weight) reads the base model as the LoRA "
            "adapter switched off: train a LoRA adapter (--lora-rank > 0) to use it"
        )
    with peft_model.disable_adapter():
        yield


def logit_rows(ex: PackedExample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions whose logits the loss needs (sorted, unique) and, for the AR targets and
    the two sides of each consistency pair, their row in that kept set."""
    ar_pos = (ex.ar_labels != IGNORE).nonzero().flatten()
    keep = torch.cat([ar_pos, ex.cons_noisy, ex.cons_clean]).unique(sorted=True)
    row = torch.full((ex.input_ids.numel(),), -1, dtype=torch.long)
    row[keep] = torch.arange(keep.numel())
    return keep, row[ar_pos], row[ex.cons_noisy], row[ex.cons_clean]


def clean_stream(ex: PackedExample) -> tuple[torch.Tensor, JacobiLayout]:
    """The packed positions of the prompt and the clean blocks, in order, and the plain causal
    layout (no blocks) that runs them: what every clean row attends to, in every variant."""
    lay = ex.layout
    i = torch.arange(lay.seq_len)
    r = i - lay.prompt_len
    clean = ((r < 0) | ((r // lay.block_size) % 2 == 1)).nonzero().flatten()
    return clean, JacobiLayout(int(clean.numel()), lay.block_size, 0)


def example_loss(
    model,
    ex: PackedExample,
    ar_weight: float = 10.0,
    temperature: float = 1.0,
    consistency_reduction: str = "mean_div_T",
    kl_weight: float = 0.0,
) -> LossParts:
    """λ·AR + consistency (+ μ·KL) for one packed example (docs/method.md §3) from one forward.

    ``consistency_reduction``: "mean_div_T" (docs/method.md §3: mean over the kept positions,
    divided by the number of blocks T) or "mean" (the plain mean; with T blocks per sequence it
    weighs the consistency term T times more against the AR term).

    ``kl_weight`` μ (optional, docs/method.md §3; 0 leaves the base objective):
    μ · KL(base ‖ model) at the AR positions, the frozen base model's next-token distribution read
    by a second, gradient-free forward of the sequence's clean stream with the LoRA adapter off. The
    AR term's one-hot targets (the base's greedy tokens) teach the base's choice where the base was
    sure and where it was torn alike, so a pattern common in the training answers (e.g. restating
    the docstring) becomes a bias that flips the base's close calls on other prompts; the KL keeps
    the base's whole distribution at every clean position instead."""
    if consistency_reduction not in CONSISTENCY_REDUCTIONS:
        raise ValueError(
            f"consistency_reduction must be one of {CONSISTENCY_REDUCTIONS}, "
            f"got {consistency_reduction!r}"
        )
    device = next(model.parameters()).device
    keep, ar_rows, noisy_rows, clean_rows = logit_rows(ex)
    with jacobi_layout(ex.layout):
        logits = model(
            input_ids=ex.input_ids[None].to(device),
            position_ids=ex.position_ids[None].to(device),
            logits_to_keep=keep.to(device),
            use_cache=False,
        ).logits[0]
    labels = ex.ar_labels[keep[ar_rows]].to(device)
    ar_tokens = int(labels.numel())
    ar = (
        F.cross_entropy(logits[ar_rows.to(device)].float(), labels, reduction="mean")
        if ar_tokens
        else logits.sum() * 0.0
    )
    cons_tokens = int(noisy_rows.numel())
    if cons_tokens:
        # Mean over kept positions, divided by the number of blocks T (docs/method.md §3);
        # the clean logits are a detached target from this same forward.
        s = soft_cross_entropy(
            logits[noisy_rows.to(device)],
            logits[clean_rows.to(device)].detach(),
            temperature,
        )
        cons = s / cons_tokens
        if consistency_reduction == "mean_div_T":
            cons = cons / ex.num_blocks
    else:
        cons = logits.sum() * 0.0
    total = ar_weight * ar + cons
    kl = 0.0
    if kl_weight and ar_tokens:
        # Clean rows see the prompt and the earlier clean blocks only (every variant), so the
        # base's logits there come from the clean stream alone, a plain causal sequence about
        # half the packed length: the noisy blocks are never run through the base.
        clean, layout = clean_stream(ex)
        row = torch.full((ex.input_ids.numel(),), -1, dtype=torch.long)
        row[clean] = torch.arange(clean.numel())
        ar_keep = row[keep[ar_rows]]
        if bool((ar_keep < 0).any()):
            raise AssertionError("an AR target sits outside the clean stream")
        with torch.no_grad(), adapter_disabled(model), jacobi_layout(layout):
            base = model(
                input_ids=ex.input_ids[clean][None].to(device),
                position_ids=ex.position_ids[clean][None].to(device),
                logits_to_keep=ar_keep.to(device),
                use_cache=False,
            ).logits[0]
            entropy = soft_cross_entropy(base, base)  # Σ_rows H(base), chunked like the CE
        # Soft CE minus the base's entropy (a constant): the KL, whose gradient is the CE's.
        kl_t = (soft_cross_entropy(logits[ar_rows.to(device)], base) - entropy) / ar_tokens
        total = total + kl_weight * kl_t
        kl = float(kl_t.detach())
    return LossParts(total, float(ar.detach()), float(cons.detach()), ar_tokens, cons_tokens, kl)
