"""generate(): greedy AR, plain Jacobi, and multi-block Jacobi with rejection recycling.

Every method produces exactly the tokens greedy autoregressive decoding produces
(docs/method.md §5): a token is committed only when it equals the model's own argmax given the
committed prefix. Under sampling (do_sample=True) the argmax is the filtered perturbed argmax of
jacobi_ext.decoding.sampling, a deterministic function of the prefix too: every method produces
exactly the tokens of autoregressive sampling with the same seed.

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
from .stopping import stop_check
from .trajectory import TrajectoryRecorder
from .tuning import Tuner

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
    step_seconds: list[float] = field(default_factory=list)  # each step, launch to host copy
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
    tuner=None,
    stopping_criteria=None,
    stop_strings: str | list[str] | None = None,
    max_time: float | None = None,
    tokenizer=None,
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

    Sampling (`do_sample=True`; jacobi_ext.decoding.sampling): `temperature`, `top_k`, `top_p`,
    `min_p` with the names, defaults and checks of transformers' GenerationConfig (a value left None
    comes from the model's generation_config, else temperature 1.0, top_k 50, top_p 1.0, min_p
    off), applied in transformers' order. Each position's token is the argmax of the filtered
    logits / temperature plus Gumbel noise keyed by (seed, the sequence's prompt and its
    occurrence among identical prompts of the batch, absolute position, token): an exact sample
    of transformers' law, and a deterministic function of the prefix, so every method returns
    the `ar` sample token for token and a sequence's sample does not depend on its batch.
    Options that read the prefix or change the search (repetition_penalty, no_repeat_ngram_size,
    num_beams, ...) raise ValueError unless left at their neutral value. `do_sample=False` is
    greedy decoding, bit for bit.

    `tuner`: the `tuning.Tuner` a tuned call consults and informs (default: one of `model`'s,
    which reads its profile from disk once and writes it once, after the call).

    Stopping (jacobi_ext.decoding.stopping): besides EOS and `max_new_tokens`,
    `stopping_criteria` (transformers `StoppingCriteria`, a `StoppingCriteriaList` or functions
    `(input_ids, scores) -> BoolTensor[batch]`), `stop_strings` (with `tokenizer`) and
    `max_time` (seconds) end a row where transformers' `generate` would end it with the same
    criteria: they are asked at every committed position with the ids transformers would pass
    there, and a row ends at its first True, that token kept. They decide where the output ends,
    never its tokens; a criterion that turns true between steps (a cancellation, the clock)
    stops the call within one step.

    `seed`: one seed for both random choices of a call: the initial draft tokens (which change
    only the speed, never the tokens) and, with do_sample, the sampling noise (which picks the
    sample). None: 0 for greedy; for sampling, drawn from torch's default generator, so
    `torch.manual_seed` makes it reproducible as in transformers. `res.seed` is the one used.
    """
    from .sampling import stream_keys

    sampling, seed = _sampling_rule(
        model, do_sample, seed, temperature, top_k, top_p, min_p, cuda_graphs, generation_kwargs
    )
    _check_args(
        model, input_ids, max_new_tokens, method, block_size, num_blocks, pool_size,
        activation_ratio,
    )  # fmt: skip
    prompts = _prompts(input_ids, attention_mask)
    recorders = _recorders(trajectory, method, block_size, lookup, len(prompts))
    _check_context(model, prompts, max_new_tokens)
    if lookup is None:
        lookup = method == "multiblock" or (method == "jacobi" and block_size is None)
    eos = eos_ids(model, eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    stop = stop_check(
        stopping_criteria, stop_strings, max_time, tokenizer, input_ids, pad, max_new_tokens
    )
    if stop is not None and recorders is not None:
        raise ValueError(
            "a trajectory records a generation to EOS or max_new_tokens: leave stopping_criteria, "
            "stop_strings and max_time unset when recording"
        )
    tuner = tuner if tuner is not None else Tuner(model)
    plan = _plan(tuner, method, block_size, num_blocks, pool_size, lookup)
    cfg = DecodeConfig(
        max_new=max_new_tokens, eos=eos, block_size=plan.n, num_blocks=plan.K,
        pool_size=plan.pool, activation_ratio=activation_ratio, cost_ratio=plan.cost_ratio,
        lookup_cost=plan.lookup_cost, cuda_graphs=cuda_graphs, sampling=sampling,
    )  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = stream_keys(prompts, seed) if sampling is not None else None
    results, stats = decode(model, prompts, cfg, gen, streamer, recorders, keys, stop)
    if streamer is not None:
        streamer.end()
    tuner.observe(
        results, stats, plan.n, plan.K, lookup=lookup,
        priced=plan.cost_ratio is not None or plan.lookup_cost is not None,
        tuned=plan.cost_ratio is not None, greedy=sampling is None,
    )  # fmt: skip
    tuner.save()
    return _result(results, stats, plan, lookup, pad, seed, sampling)


@dataclass
class _Plan:
    """The settings a call decodes with: method, block size n, blocks in flight K, candidate
    pool, and the curve's cost ratio (None: untuned, no controller) and lookup drafts' cost."""

    method: str
    n: int
    K: int
    pool: int
    cost_ratio: object = None
    lookup_cost: object = None


def _plan(tuner, method, block_size, num_blocks, pool_size, lookup) -> _Plan:
    """The call's settings: as given, or (block_size None) the tuner's choice from the measured
    curve and the acceptance this model has shown, with an online fallback to AR when the
    acceptance observed now is too low (the cost ratio the controller weighs it by)."""
    cost_ratio = None
    if method == "ar":
        plan = _Plan("ar", 1, 1, 0)
    else:
        if block_size is None:
            curve = tuner.curve()
            s = tuner.choose(method, num_blocks, pool_size, lookup=lookup, curve=curve)
            block_size, num_blocks, pool_size = s.block_size, s.num_blocks, s.pool_size
            method, cost_ratio = s.method, curve.cost_ratio
        K, p = (1, 0) if method == "jacobi" else (num_blocks, pool_size)
        plan = _Plan("ar", 1, 1, 0) if method == "ar" else _Plan(method, block_size, K, p)
    plan.cost_ratio = cost_ratio
    if lookup:  # a fixed block size too: drafts are weighed by their cost
        plan.lookup_cost = cost_ratio if cost_ratio is not None else tuner.curve().cost_ratio
    return plan


def _sampling_rule(model, do_sample, seed, temperature, top_k, top_p, min_p, cuda_graphs, kwargs):
    """(SamplingConfig or None for greedy, the call's seed), the arguments checked."""
    from .graphs import graphs_wanted
    from .sampling import check_unsupported, sampling_config

    check_unsupported(kwargs)
    graphs_wanted(torch.device("cpu"), cuda_graphs)  # a bad value fails here, on any device
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
                stacklevel=3,
            )
        seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    return sampling, seed


def _recorders(trajectory, method, block_size, lookup, batch) -> list | None:
    """The trajectory recorders, one per sequence, checked against the call's settings."""
    if trajectory is None:
        return None
    recorders = list(trajectory) if isinstance(trajectory, (list, tuple)) else [trajectory]
    if method != "jacobi" or block_size is None or lookup:
        raise ValueError(
            "recording a trajectory needs method='jacobi', a fixed block_size and lookup "
            "off (a lookup win is not a Jacobi iteration)"
        )
    if len(recorders) != batch:
        raise ValueError(
            f"trajectory: {len(recorders)} recorder(s) for a batch of {batch} "
            "prompts: pass one TrajectoryRecorder per sequence"
        )
    return recorders


def _check_context(model, prompts, max_new_tokens) -> None:
    limit = _max_positions(model)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's context of {limit} positions"
        )


def _result(results, stats, plan: _Plan, lookup, pad, seed, sampling) -> GenerateResult:
    """The call's GenerateResult: rows padded with `pad` to the longest."""
    rows = [r.tokens for r in results]
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return GenerateResult(
        tokens=tokens,
        forwards=stats.forwards,
        seconds=stats.seconds,
        method=plan.method + ("+lookup" if lookup else ""),
        block_size=plan.n,
        num_blocks=plan.K,
        pool_size=plan.pool,
        prefill_seconds=stats.prefill_seconds,
        lengths=[len(r) for r in rows],
        accepted=[a for r in results for a in r.accepted],
        verify_seconds=stats.host_seconds,
        candidate_wins=sum(r.candidate_wins for r in results),
        lookup_wins=sum(r.lookup_wins for r in results),
        warmup_seconds=stats.warmup_seconds,
        step_seconds=list(stats.step_seconds),
        graph_replays=stats.graph_replays,
        seed=seed,
        sampling=sampling,
    )
