"""Exact sampling for every decoding method: the filtered perturbed argmax.

The token predicted at absolute position `pos` of a sequence is

    argmax over kept v of  logits_v / temperature + G(seed, stream, pos, v)

with G standard Gumbel noise from Philox4x32-10 keyed by (seed, the sequence's stream, pos, v),
and the kept set given by transformers' filters in transformers' order (temperature, top-k, top-p
on the top-k-filtered law, min-p). One position's token is an exact draw from transformers' law
(the Gumbel-max trick); and because the noise belongs to the position, not to the forward that
evaluates it, the token is a deterministic function of the prefix, exactly like greedy's argmax.
So the greedy machinery (Jacobi fixed points, verification, acceptance, recycling, lookup) is
unchanged: a Jacobi fixed point under this rule is the autoregressive sample with the same noise,
and every method returns token for token the output of `ar` with the same seed.

The op `torch.ops.jacobi_ext.gumbel_argmax` (csrc/include/jacobi/sampling.h; CPU and CUDA)
replaces the forward's argmax; this module holds the options, their checks, the per-sequence
stream keys, and a pure-torch reference of the op (`philox4x32_10`, `gumbel_noise`,
`gumbel_argmax_reference`) that the tests compare against.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..kernels import _native  # noqa: F401  (registers torch.ops.jacobi_ext)

# transformers' GenerationConfig defaults for the sampling filters.
DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}

# Generation options that read the prefix or change the search: not a per-position filter, so
# not expressible as this argmax. Accepted only at their neutral value.
UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "min_length": 0,
    "min_new_tokens": None,
    "num_beams": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "guidance_scale": None,
    "logits_processor": None,
    "renormalize_logits": False,
    "exponential_decay_length_penalty": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
}


@dataclass(frozen=True)
class SamplingConfig:
    """The filters of a sampled call. top_k 0, top_p 1.0 and min_p 0.0 are off."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0


def check_unsupported(options: dict) -> None:
    """Refuse generation options this library cannot honour exactly (see UNSUPPORTED); an unknown
    name is a TypeError, as for any function."""
    for name, value in options.items():
        if name not in UNSUPPORTED:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        neutral = UNSUPPORTED[name]
        if value is None or value == neutral or (name == "min_new_tokens" and value == 0):
            continue
        raise ValueError(
            f"{name}={value!r} is not supported: jacobi_ext samples with per-position filters "
            "only (temperature, top_k, top_p, min_p); options that read the prefix "
            "(repetition penalties, n-gram bans) or change the search (beams) are out of scope. "
            f"Leave {name} unset (or {neutral!r})"
        )


def _model_default(model, name: str):
    cfg = getattr(model, "generation_config", None)
    value = getattr(cfg, name, None) if cfg is not None else None
    return DEFAULTS[name] if value is None else value


def sampling_config(
    model=None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> SamplingConfig:
    """The checked filters of a sampled call. A value left None comes, as in transformers'
    generate, from the model's generation_config, else from GenerationConfig's default
    (temperature 1.0, top_k 50, top_p 1.0, min_p off). Raises ValueError with the allowed range."""
    vals = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name, v in vals.items():
        if v is None:
            vals[name] = _model_default(model, name) if model is not None else DEFAULTS[name]
    t, k, p, m = vals["temperature"], vals["top_k"], vals["top_p"], vals["min_p"]
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
        raise ValueError(
            f"temperature must be a float > 0 (use do_sample=False for greedy decoding), got {t!r}"
        )
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 or None: off), got {k!r}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be a float in (0, 1] (1.0: off), got {p!r}")
    if m is None:
        m = 0.0
    if isinstance(m, bool) or not isinstance(m, numbers.Real) or not 0.0 <= m <= 1.0:
        raise ValueError(f"min_p must be a float in [0, 1] (None or 0: off), got {m!r}")
    return SamplingConfig(float(t), int(k), float(p), float(m))


# ---- per-sequence noise streams ----------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def stream_key(prompt: list[int], occurrence: int = 0) -> int:
    """The noise stream of a sequence: a 64-bit hash of its prompt tokens and of how many
    identical prompts came before it in the batch. A sequence's sample therefore depends only on
    (seed, its prompt, its occurrence), never on the other sequences of its batch or on its place
    there: `generate([x, y])[1]` is `generate([y])[0]`, and `generate([x, x])` gives two
    independent samples of x, the first of which is `generate([x])`'s."""
    h = _mix64(len(prompt) ^ 0x6A09E667F3BCC908)
    for t in prompt:
        h = _mix64(h ^ (t & _MASK64))
    return _signed(_mix64(h ^ _mix64(occurrence + 0x3C6EF372FE94F82B)))


def stream_keys(prompts: list[list[int]], seed: int) -> torch.Tensor:
    """keys [B, 2] int64 of a batch: (seed, stream_key(prompt, occurrence)) per sequence."""
    seen: dict[tuple[int, ...], int] = {}
    rows = []
    for pr in prompts:
        k = tuple(pr)
        occ = seen.get(k, 0)
        seen[k] = occ + 1
        rows.append([_signed(seed & _MASK64), stream_key(pr, occ)])
    return torch.tensor(rows, dtype=torch.long)


class Sampler:
    """The decoding's token rule under sampling (runtime.targets' replacement): the token each
    logits row predicts, from the rows' RoPE positions (the predicted token sits one further).
    `keys` is a static device buffer [B, 2], rewritten in place per batch (CUDA graphs read it)."""

    def __init__(self, cfg: SamplingConfig, keys: torch.Tensor) -> None:
        self.cfg, self.keys = cfg, keys

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return torch.ops.jacobi_ext.gumbel_argmax(
            logits, self.keys, positions + 1, c.temperature, c.top_k, c.top_p, c.min_p
        )


# ---- the pure-torch reference of the op (tests) ------------------------------------------------
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mulhilo(m: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of m * b for a constant m < 2^32 and b < 2^32 (int64 tensors),
    through 16-bit limbs so that no int64 product overflows."""
    t1 = m * (b & 0xFFFF)  # < 2^48
    t2 = m * (b >> 16)  # < 2^48
    s = t1 + ((t2 & 0xFFFF) << 16)  # < 2^49
    return (t2 >> 16) + (s >> 32), s & _U32


def philox4x32_10(counter: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding uint32 words (the op's generator, restated)."""
    c0, c1, c2, c3 = (c & _U32 for c in counter)
    k0, k1 = key[0] & _U32, key[1] & _U32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
    return [c0, c1, c2, c3]


def noise_bits(seed: int, stream: int, pos: int, vocab: int) -> torch.Tensor:
    """The 53 random bits of (seed, stream, pos, v) for v in range(vocab), int64 [vocab]."""
    v = torch.arange(vocab, dtype=torch.long)
    s, st = seed & _MASK64, stream & _MASK64
    ctr = [v, torch.full_like(v, pos & _U32), torch.full_like(v, st & _U32),
           torch.full_like(v, st >> 32)]  # fmt: skip
    o = philox4x32_10(ctr, (s & _U32, s >> 32))
    return (o[0] << 21) | (o[1] >> 11)  # ((o0 << 32) | o1) >> 11, in 53 bits


def gumbel_noise(seed: int, stream: int, pos: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] (float64) of one position: -log(-log u), u in (0, 1)."""
    u = (noise_bits(seed, stream, pos, vocab).double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


def filtered_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """x = logits / temperature (float64) with -inf outside the kept set, the rules of
    csrc/include/jacobi/sampling.h, for any leading shape."""
    x = logits.double() / cfg.temperature + 0.0
    V = x.shape[-1]
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < cfg.top_k < V:
        kth = x.topk(cfg.top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    x_max = x.amax(-1, keepdim=True)
    if cfg.top_p < 1.0:
        e = torch.where(keep, torch.exp(x - x_max), 0.0)
        target = cfg.top_p * e.sum(-1, keepdim=True)
        xs, order = torch.where(keep, x, -math.inf).sort(dim=-1, descending=True, stable=True)
        cum = e.gather(-1, order).cumsum(-1)
        reach = cum >= target
        first = reach.long().argmax(-1, keepdim=True)  # the first index reaching p * Z
        last = keep.sum(-1, keepdim=True) - 1  # none (rounding short of p * Z): keep them all
        first = torch.where(reach.any(-1, keepdim=True), first, last)
        keep &= x >= xs.gather(-1, first)
    if cfg.min_p > 0.0:
        keep &= torch.exp(x - x_max) >= cfg.min_p
    return torch.where(keep, x, -math.inf)


def gumbel_argmax_reference(
    logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, cfg: SamplingConfig
) -> torch.Tensor:
    """The op, in torch: logits [B, Q, V], keys [B, 2], positions [B, Q] -> tokens [B, Q]."""
    B, Q, V = logits.shape
    x = filtered_logits(logits.cpu(), cfg)
    out = torch.empty(B, Q, dtype=torch.long)
    for b in range(B):
        seed, stream = (int(k) for k in keys[b].tolist())
        for q in range(Q):
            g = gumbel_noise(seed, stream, int(positions[b, q]), V)
            out[b, q] = torch.argmax(x[b, q] + g)  # the first maximum: ties to the lower index
    return out
