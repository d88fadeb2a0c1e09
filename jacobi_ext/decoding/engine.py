"""generate(): greedy AR, plain Jacobi, and multi-block Jacobi with rejection recycling.

Every method produces exactly the tokens greedy autoregressive decoding produces (SPEC §1, §6):
a token is committed only when it equals the model's own argmax given the committed prefix.
Under sampling (do_sample=True) the argmax is the filtered perturbed argmax of
jacobi_ext.sampling, a deterministic function of the prefix too: every method produces exactly
the tokens of autoregressive sampling with the same seed.

The pieces, one job each: loop.py (prefill and the batched step loop), sequence.py (one
sequence's state and step work: AR and parallel modes, the verify op), runtime.py (the static
KV cache, fixed-shape steps, CUDA graphs), masks.py (the step's mask and positions, on the
device), lookup.py (context-lookup drafts), controller.py (fallback to AR), trajectory.py
(recording for distillation), tuning.py (the measured cost curve).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .loop import DecodeConfig, decode
from .trajectory import TrajectoryRecorder

METHODS = ("ar", "jacobi", "multiblock")


@dataclass
class GenerateResult:
    """What `generate` returns. `tokens` holds only the generated tokens (EOS included if hit);
    for a batch, rows shorter than the longest are padded with `pad_token_id` and `lengths`
    gives each row's length."""

    tokens: torch.Tensor
    forwards: int
    seconds: float
    method: str
    block_size: int
    num_blocks: int
    pool_size: int
    prefill_seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens committed by each forward
    verify_seconds: float = 0.0  # host time outside the device step: planning, bookkeeping
    candidate_wins: int = 0  # steps whose committed tokens came from a candidate row
    lookup_wins: int = 0  # of those, steps won by the context-lookup candidate
    warmup_seconds: float = 0.0  # this call's CUDA graph capture / compile (once per width bucket)
    graph_replays: int = 0  # this call's steps replayed from a captured (or compiled) CUDA graph
    seed: int = 0  # the seed of the initial drafts and (do_sample) of the sampling noise
    sampling: object = None  # the SamplingConfig the call sampled with; None: greedy

    @property
    def new_tokens(self) -> int:
        return sum(self.lengths) if self.lengths else int(self.tokens.shape[-1])

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / max(self.forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def eos_ids(model, eos_token_id=None, tokenizer=None) -> set[int]:
    """The token ids that end a generation: `eos_token_id` (an int or several) where given, else
    the model's generation config, its config, and last the tokenizer's EOS."""
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _check_args(
    model, input_ids, max_new_tokens, method, block_size, num_blocks, pool_size, activation_ratio
) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_len]")
    if input_ids.dim() == 1:
        raise ValueError(
            f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}; "
            "use input_ids[None] for a single prompt"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must be [batch, prompt_len], got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: generation needs at least one prompt token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size is not None and block_size < 2:
        raise ValueError(f"block_size must be >= 2 (or None to tune it), got {block_size}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if pool_size < 0:
        raise ValueError(f"pool_size must be >= 0, got {pool_size}")
    if not 0.0 < activation_ratio <= 1.0:
        raise ValueError(f"activation_ratio must be in (0, 1], got {activation_ratio}")
    vocab = model.get_output_embeddings().out_features  # nn.Linear or GGUFLinear
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab})")


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """The real tokens of each row: all of them, or those the (left-padding) mask keeps."""
    if attention_mask is None:
        return input_ids.tolist()
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(getattr(attention_mask, 'shape', ()))}"
        )
    m = attention_mask.to("cpu", torch.long)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    out = []
    for b, (row, ids) in enumerate(zip(m.tolist(), input_ids.tolist(), strict=True)):
        k = row.index(1) if 1 in row else len(row)
        if k == len(row):
            raise ValueError(f"row {b} of attention_mask is all padding: its prompt is empty")
        if 0 in row[k:]:
            raise ValueError(
                f"row {b} of attention_mask has padding after its first token; pad prompts on "
                "the left (tokenizer.padding_side = 'left')"
            )
        out.append(ids[k:])
    return out


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 256,
    method: str = "multiblock",
    block_size: int | None = None,
    num_blocks: int = 2,
    pool_size: int = 4,
    activation_ratio: float = 0.85,
    eos_token_id: int | list[int] | None = None,
    streamer=None,
    seed: int | None = None,
    pad_token_id: int | None = None,
    trajectory: TrajectoryRecorder | list[TrajectoryRecorder] | None = None,
    lookup: bool | None = None,
    attention_mask: torch.Tensor | None = None,
    cuda_graphs: bool | str | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    **generation_kwargs,
) -> GenerateResult:
    """Generate with `method` ("ar" | "jacobi" | "multiblock"), greedily or (do_sample=True)
    by sampling; the tokens equal those of autoregressive decoding (`method="ar"`) under the same
    rule and seed, for every method, every sequence of a batch.

    input_ids [B, P]; with `attention_mask` (1 = token, 0 = padding), prompts of different
    lengths are left-padded, as transformers' generate takes them. The batch is decoded
    together, one forward per step; each sequence has its own blocks and stops at its own EOS.

    block_size None = chosen for this machine and model by the roofline tuner
    (`jacobi_ext.decoding.tuning`). "jacobi" is one block and no recycling; "multiblock" keeps up
    to `num_blocks` blocks in flight (a new one starts when the newest has converged
    `activation_ratio` of its tokens) and verifies up to `pool_size` recycled candidates per
    step. Generation stops at EOS (`eos_token_id`, default: the model's generation config) or
    after `max_new_tokens`. `trajectory` (method "jacobi" with a fixed block_size, lookup off)
    records every iteration's block states for distillation (python_training): one recorder,
    or a list of one per sequence of the batch.

    `lookup` verifies context-lookup drafts too (lossless, like prompt-lookup decoding): in the
    parallel methods one more candidate row per step, in AR the drafts after the next token;
    how many, and whether at all, per match class from the measured cost curve and the
    acceptance such drafts have shown. Default (None): on for "multiblock" and for tuned
    settings (block_size=None), off for "ar" and a fixed-size "jacobi" (the paper's plain
    methods). `res.method` then ends in "+lookup".

    `cuda_graphs` (CUDA only; default on, or env JACOBI_EXT_CUDA_GRAPHS=0 for off): replay each
    step width (the whole step of the batch) from a captured graph (runtime.py, step.py).
    "compile" (or JACOBI_EXT_CUDA_GRAPHS=compile) runs the same step through
    torch.compile(mode="reduce-overhead") instead of direct capture; True = "capture".

    Sampling (`do_sample=True`; jacobi_ext.sampling): `temperature`, `top_k`, `top_p`, `min_p`
    with the names, defaults and checks of transformers' GenerationConfig (a value left None
    comes from the model's generation_config, else temperature 1.0, top_k 50, top_p 1.0, min_p
    off), applied in transformers' order. Each position's token is the argmax of the filtered
    logits / temperature plus Gumbel noise keyed by (seed, the sequence's prompt and its
    occurrence among identical prompts of the batch, absolute position, token): an exact sample
    of transformers' law, and a deterministic function of the prefix, so every method returns
    the `ar` sample token for token and a sequence's sample does not depend on its batch.
    Options that read the prefix or change the search (repetition_penalty, no_repeat_ngram_size,
    num_beams, ...) raise ValueError unless left at their neutral value. `do_sample=False` is
    greedy decoding, bit for bit.

    `seed`: one seed for both random choices of a call: the initial draft tokens (which change
    only the speed, never the tokens) and, with do_sample, the sampling noise (which picks the
    sample). None: 0 for greedy; for sampling, drawn from torch's default generator, so
    `torch.manual_seed` makes it reproducible as in transformers. `res.seed` is the one used.
    """
    from ..sampling import check_unsupported, sampling_config, stream_keys
    from .runtime import _graphs_wanted

    check_unsupported(generation_kwargs)
    _graphs_wanted(torch.device("cpu"), cuda_graphs)  # a bad value fails here, on any device
    sampling = None
    if do_sample:
        sampling = sampling_config(model, temperature, top_k, top_p, min_p)
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()))
    else:
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            warnings.warn(
                f"do_sample=False: {', '.join(given)} only apply to sampling and are ignored "
                "(greedy decoding); pass do_sample=True to sample",
                UserWarning,
                stacklevel=2,
            )
        seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    _check_args(
        model,
        input_ids,
        max_new_tokens,
        method,
        block_size,
        num_blocks,
        pool_size,
        activation_ratio,
    )
    prompts = _prompts(input_ids, attention_mask)
    recorders = None
    if trajectory is not None:
        recorders = list(trajectory) if isinstance(trajectory, (list, tuple)) else [trajectory]
        if method != "jacobi" or block_size is None or lookup:
            raise ValueError(
                "recording a trajectory needs method='jacobi', a fixed block_size and lookup "
                "off (a lookup win is not a Jacobi iteration)"
            )
        if len(recorders) != len(prompts):
            raise ValueError(
                f"trajectory: {len(recorders)} recorder(s) for a batch of {len(prompts)} "
                "prompts: pass one TrajectoryRecorder per sequence"
            )
    if lookup is None:
        lookup = method == "multiblock" or (method == "jacobi" and block_size is None)
    eos = eos_ids(model, eos_token_id)
    limit = _max_positions(model)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's context of {limit} positions"
        )
    cost_ratio = None  # no controller unless the settings are tuned
    if method == "ar":
        n, K, p = 1, 1, 0
    else:
        if block_size is None:
            # Tuned: the block size from the measured curve and the acceptance this model has
            # shown, and an online fallback to AR when the acceptance observed now is too low.
            from .tuning import choose_settings, step_curve

            curve = step_curve(model)
            s = choose_settings(
                model, method=method, num_blocks=num_blocks, pool_size=pool_size, curve=curve,
                lookup=lookup,
            )  # fmt: skip
            block_size, num_blocks, pool_size = s.block_size, s.num_blocks, s.pool_size
            method = s.method
            cost_ratio = curve.cost_ratio
        n = block_size
        K, p = (1, 0) if method == "jacobi" else (num_blocks, pool_size)
        if method == "ar":
            n, K, p = 1, 1, 0
    lookup_cost = cost_ratio
    if lookup and lookup_cost is None:  # a fixed block size: still weigh drafts by their cost
        from .tuning import step_curve

        lookup_cost = step_curve(model).cost_ratio
    cfg = DecodeConfig(
        max_new=max_new_tokens,
        eos=eos,
        block_size=n,
        num_blocks=K,
        pool_size=p,
        activation_ratio=activation_ratio,
        cost_ratio=cost_ratio,
        lookup_cost=lookup_cost if lookup else None,
        cuda_graphs=cuda_graphs,
        sampling=sampling,
    )
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = stream_keys(prompts, seed) if sampling is not None else None
    results, stats = decode(model, prompts, cfg, gen, streamer, recorders, keys)
    if streamer is not None:
        streamer.end()
    if cost_ratio is not None or lookup_cost is not None:
        from .tuning import remember_step_times  # the curve learns from the steps it priced

        remember_step_times(model, stats.widths, stats.step_seconds)
    if sampling is None and n > 1:
        # Every greedy parallel call, tuned or not, tells the tuner the model's acceptance (a
        # fixed `jacobi` n=16 call before the first tuned one, as in the demo, informs it). Only
        # greedy acceptance is remembered: a sampled call converges later, and its own controller
        # falls back to AR when its acceptance does not pay.
        from .tuning import estimate_rho, remember_acceptance

        window = n + (K - 1) * n // 2  # as tuning.predict credits K blocks
        for r in results:
            if r.mean_accepted_parallel is not None:  # None unless parallel steps ran
                rho = estimate_rho(r.mean_accepted_parallel, window)
                remember_acceptance(model, rho, weight=len(r.accepted))
    if cost_ratio is not None and sampling is None:
        from .tuning import AR_LOOKUP, PARALLEL, remember_mode_speed

        cost = sum(r.cost or 0.0 for r in results)
        if lookup and cost > 0:  # the race of tuning.choose_settings: its speed over plain AR
            committed = sum(len(r.tokens) for r in results)
            mode = PARALLEL if n > 1 else AR_LOOKUP
            remember_mode_speed(model, mode, committed / cost, weight=committed)
    rows = [r.tokens for r in results]
    width = max(len(r) for r in rows)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    if lookup:
        method += "+lookup"
    return GenerateResult(
        tokens=tokens,
        forwards=stats.forwards,
        seconds=stats.seconds,
        method=method,
        block_size=n,
        num_blocks=K,
        pool_size=p,
        prefill_seconds=stats.prefill_seconds,
        lengths=[len(r) for r in rows],
        accepted=[a for r in results for a in r.accepted],
        verify_seconds=stats.host_seconds,
        candidate_wins=sum(r.candidate_wins for r in results),
        lookup_wins=sum(r.lookup_wins for r in results),
        warmup_seconds=stats.warmup_seconds,
        graph_replays=stats.graph_replays,
        seed=seed,
        sampling=sampling,
    )
