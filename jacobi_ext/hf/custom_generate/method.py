"""Jacobi decoding behind transformers' `generate` API (a "custom generation method").

transformers calls `generate(model=..., **every_argument_of_model.generate)` from
`custom_generate/generate.py` (this package's `generate.py` re-exports the function below):
- `model.generate(ids, custom_generate=jacobi_ext.CUSTOM_GENERATE, trust_remote_code=True, ...)`
  for any model;
- `model.generate(ids, ...)` on a model loaded with `from_pretrained(DIR,
  trust_remote_code=True)` from a folder that ships `custom_generate/` (`jacobi-forcing
  export`): there transformers binds `functools.partial(generate, model=model)`, so the prompt
  may arrive positionally while `model` is a keyword;
- `transformers serve DIR --trust-remote-code`, which passes `input_ids`, `attention_mask`,
  `generation_config`, `streamer` and `tokenizer` as keywords, the request's `stop` as
  `stop_strings`, and (5.25 on, not streamed) `stopping_criteria=[stop_if_cancelled]`.

It returns what transformers' `generate` returns for a decoder-only model: the prompt followed
by the new tokens, `LongTensor[B, prompt + new]` (rows that stopped early padded with
`pad_token_id`), or a `GenerateDecoderOnlyOutput` with `sequences` when
`return_dict_in_generate=True`. The tokens are `jacobi_ext.generate`'s: greedy's (or, with
`do_sample=True`, autoregressive sampling's under the same seed), exactly.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings

import torch

logger = logging.getLogger("jacobi_ext.hf.custom_generate")

# JACOBI_EXT_GENERATE_LOG=path: each call appends one JSON line (method, new tokens, forwards,
# seconds): which decoding ran behind `model.generate`, e.g. inside `transformers serve`.
LOG_ENV = "JACOBI_EXT_GENERATE_LOG"

# Our settings: the name of the keyword argument (also accepted without the prefix, as
# jacobi_ext.generate spells it) and of the generation_config key, and the argument of
# jacobi_ext.generate it sets. A value given as a keyword wins over the generation_config's.
JACOBI_KEYS = {
    "jacobi_method": "method",  # "ar" | "jacobi" | "multiblock" (default "multiblock")
    "jacobi_block_size": "block_size",  # int >= 2, or None / "auto": tuned on this machine
    "jacobi_num_blocks": "num_blocks",  # multiblock: blocks in flight (default 2)
    "jacobi_pool_size": "pool_size",  # multiblock: recycled candidates per step (default 4)
    "jacobi_activation_ratio": "activation_ratio",  # multiblock: when a new block starts
    "jacobi_lookup": "lookup",  # context-lookup drafts: True / False / None (default: by method)
    "jacobi_seed": "seed",  # the initial drafts and (do_sample) the sampling noise
    "jacobi_cuda_graphs": "cuda_graphs",  # CUDA: True / False / "compile"
}

# transformers' generate parameters in their positional order (`model.generate(ids, config)`).
_POSITIONAL = (
    "inputs",
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)

# Arguments whose presence changes what generate does, and which this method cannot honour
# exactly: refused unless empty / None.
_REFUSED_ARGS = {
    "logits_processor": "an arbitrary logits_processor",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn (constrained decoding)",
    "assistant_model": "assistant_model (use our own parallel decoding instead)",
    "negative_prompt_ids": "negative_prompt_ids (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask",
    "inputs_embeds": "inputs_embeds (pass token ids)",
    "past_key_values": "past_key_values (a cache is built per call)",
    "cache": "cache (a cache is built per call)",
}

# Accepted and without effect here: how transformers' own generate manages its cache, serve's
# modality switch.
_IGNORED_ARGS = {"use_cache", "generation_mode", "synced_gpus", "return_legacy_cache"}

# generation_config fields that ask for outputs this method does not compute.
_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _bind(args: tuple, kwargs: dict, model) -> tuple[object, dict]:
    if model is None:
        if not args:
            raise TypeError("generate() missing the model (first positional or model=)")
        model, args = args[0], args[1:]
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"generate() takes at most {len(_POSITIONAL)} positional arguments")
    for name, value in zip(_POSITIONAL, args, strict=False):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        kwargs[name] = value
    return model, kwargs


def _prompt(kwargs: dict) -> torch.Tensor:
    inputs, input_ids = kwargs.pop("inputs", None), kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("pass the prompt once: as `inputs` (positional) or as `input_ids`")
    ids = inputs if inputs is not None else input_ids
    if ids is None:
        raise ValueError("generate() needs a prompt: input_ids [B, P] (or [P])")
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids [B, P], got {tuple(ids.shape)}")
    return ids.long()


def _refuse(name: str, what: str) -> None:
    raise ValueError(
        f"{name} is not supported: {what} cannot be combined with lossless Jacobi decoding, "
        "which commits exactly the tokens of greedy decoding (or of sampling with per-position "
        "filters: temperature, top_k, top_p, min_p). Leave it unset, or use transformers' own "
        "generate (without custom_generate=, or a model loaded without trust_remote_code)"
    )


def _is_empty(value) -> bool:
    if value is None or value is False:
        return True
    try:
        return len(value) == 0
    except TypeError:
        return False


def _log_call(res, batch: int) -> None:
    record = {
        "method": res.method,
        "batch": batch,
        "new_tokens": res.new_tokens,
        "forwards": res.forwards,
        "tokens_per_forward": round(res.tokens_per_forward, 4),
        "seconds": round(res.seconds, 6),
        "block_size": res.block_size,
    }
    logger.info("jacobi_ext generate: %s", record)
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def generate(*args, model=None, **kwargs):
    """`model.generate(...)` with Jacobi / multi-block decoding (jacobi_ext.generate).

    Takes transformers' arguments: the prompt (`inputs` positionally or `input_ids=`),
    `attention_mask` (left padding), `generation_config` (else the model's) and any of its fields
    as keywords (`max_new_tokens`, `max_length`, `eos_token_id`, `pad_token_id`, `do_sample`,
    `temperature`, `top_k`, `top_p`, `min_p`, `return_dict_in_generate`, `stop_strings`,
    `max_time`), `streamer`, `stopping_criteria` and `tokenizer` (for stop strings): a row ends
    where transformers' own generate would end it with the same criteria. Our
    settings come from keywords or from the generation_config's custom keys (JACOBI_KEYS):
    `jacobi_method` (or `method`), `jacobi_block_size` (`block_size`), `jacobi_num_blocks`,
    `jacobi_pool_size`, `jacobi_activation_ratio`, `jacobi_lookup`, `jacobi_seed` (`seed`),
    `jacobi_cuda_graphs`. What cannot be done losslessly (beams, repetition penalties, logits
    processors, ...) raises ValueError.
    """
    from jacobi_ext.decoding import generate as jacobi_generate

    model, kwargs = _bind(args, kwargs, model)
    ids = _prompt(kwargs)
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    # Stopping criteria decide where the output ends, never its tokens: honoured, asked at every
    # committed position (jacobi_ext.decoding.stopping). The tokenizer reads stop strings.
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    tokenizer = kwargs.pop("tokenizer", None)
    for name, what in _REFUSED_ARGS.items():
        if not _is_empty(kwargs.pop(name, None)):
            _refuse(name, what)
    for name in _IGNORED_ARGS:
        kwargs.pop(name, None)

    ours = _our_keywords(kwargs)
    gc, explicit = _generation_config(model, kwargs, ours)
    _check_exact(gc)
    max_new = _max_new_tokens(gc, model, ids, attention_mask)
    eos = gc.eos_token_id
    pad = gc.pad_token_id
    if pad is None:
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)

    device = next(model.parameters()).device
    ids = ids.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    res = jacobi_generate(
        model,
        ids,
        max_new_tokens=max_new,
        attention_mask=attention_mask,
        eos_token_id=eos,
        pad_token_id=pad,
        streamer=streamer,
        stopping_criteria=stopping_criteria,
        stop_strings=gc.stop_strings,
        max_time=gc.max_time,
        tokenizer=tokenizer,
        **ours,
        **_sampling_args(gc, explicit),
    )
    _log_call(res, ids.shape[0])
    new = res.tokens.to(device=device, dtype=torch.long)
    if new.dim() == 1:
        new = new.unsqueeze(0)
    sequences = torch.cat([ids, new], dim=1)
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _our_keywords(kwargs: dict) -> dict:
    """Our settings given as keywords (prefixed `jacobi_*` or not), taken out of kwargs."""
    ours: dict = {}
    for key, arg in JACOBI_KEYS.items():
        if key in kwargs and arg in kwargs and kwargs[key] != kwargs[arg]:
            raise ValueError(f"{key}={kwargs[key]!r} and {arg}={kwargs[arg]!r} disagree")
        if key in kwargs or arg in kwargs:
            ours[arg] = kwargs.pop(key) if key in kwargs else kwargs.pop(arg)
            kwargs.pop(arg, None)
    return ours


def _generation_config(model, kwargs: dict, ours: dict):
    """(the call's GenerationConfig, the fields given as keywords). The one passed in (else the
    model's) with the keywords set on a copy; what it leaves unset (our keys, EOS, pad) falls back
    to the model's, as transformers' use_model_defaults does. Fills `ours` from its custom keys."""
    from transformers import GenerationConfig

    model_gc = getattr(model, "generation_config", None)
    base = kwargs.pop("generation_config", None)
    if base is None:
        base = model_gc or GenerationConfig()
    gc = copy.deepcopy(base)
    explicit = {k: v for k, v in kwargs.items() if hasattr(gc, k)}
    unknown = sorted(k for k in kwargs if not hasattr(gc, k))
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} "
            f"(jacobi_ext's settings: {', '.join(JACOBI_KEYS)})"
        )
    for k, v in explicit.items():
        setattr(gc, k, v)
    for key, arg in JACOBI_KEYS.items():
        for source in (gc, model_gc):
            if arg not in ours and getattr(source, key, None) is not None:
                ours[arg] = getattr(source, key)
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(gc, name, None) is None and getattr(model_gc, name, None) is not None:
            setattr(gc, name, getattr(model_gc, name))
    if ours.get("block_size") == "auto":
        ours["block_size"] = None
    return gc, explicit


def _check_exact(gc) -> None:
    """Refuse what cannot be done exactly: the engine's own check, with transformers' values."""
    from jacobi_ext.decoding.sampling import UNSUPPORTED, check_unsupported

    check_unsupported({n: getattr(gc, n, None) for n in UNSUPPORTED if n != "logits_processor"})
    if getattr(gc, "return_dict_in_generate", False):
        for flag in _OUTPUT_FLAGS:
            if getattr(gc, flag, False):
                _refuse(flag, f"{flag} (per-step scores / states are not kept)")
    if getattr(gc, "cache_implementation", None) == "paged":
        _refuse("cache_implementation='paged'", "continuous batching (transformers' own loop)")


def _max_new_tokens(gc, model, ids: torch.Tensor, attention_mask) -> int:
    """max_new_tokens, else max_length - prompt, as transformers; cut (with a warning) to the
    model's context after the longest prompt of the batch."""
    prompt_len = int(ids.shape[1])
    max_new = gc.max_new_tokens
    if max_new is None:
        max_length = gc.max_length if gc.max_length is not None else 20
        max_new = max_length - prompt_len
    if max_new <= 0:
        raise ValueError(
            f"no room to generate: max_new_tokens={gc.max_new_tokens}, max_length={gc.max_length}"
            f", prompt of {prompt_len} tokens"
        )
    context = getattr(model.config, "max_position_embeddings", None)
    if attention_mask is not None:
        longest = int(attention_mask.sum(dim=1).max())
    else:
        longest = prompt_len
    if context is not None and longest + max_new > context:
        if longest >= context:
            raise ValueError(f"the prompt ({longest} tokens) fills the context ({context})")
        warnings.warn(
            f"max_new_tokens={max_new} runs past the model's context of {context} positions "
            f"after a {longest}-token prompt: generating at most {context - longest}",
            UserWarning,
            stacklevel=3,
        )
        max_new = context - longest
    return max_new


def _sampling_args(gc, explicit: dict) -> dict:
    """The engine's sampling keywords: the config's filters when it samples; under greedy, only
    filters passed by hand (the engine warns that they are ignored)."""
    if gc.do_sample:
        return {
            "do_sample": True,
            "temperature": gc.temperature,
            "top_k": gc.top_k,
            "top_p": gc.top_p,
            "min_p": gc.min_p,
        }
    return {
        k: explicit[k]
        for k in ("temperature", "top_k", "top_p", "min_p")
        if explicit.get(k) is not None
    }
