"""`jacobi-forcing export`: a model as a self-contained Hugging Face folder that decodes with
Jacobi / multi-block decoding through transformers' own API.

The folder holds the merged weights (safetensors), config.json, the tokenizer,
generation_config.json with our settings (`jacobi_method`, `jacobi_block_size`, ...; see
jacobi_ext.hf.custom_generate.JACOBI_KEYS), `custom_generate/` (transformers' custom generation
method: `generate.py` calls the installed jacobi_ext) and a model card (README.md). Then

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    model.generate(ids, max_new_tokens=128)          # Jacobi decoding, greedy's tokens

and `transformers serve DIR --trust-remote-code` serves it (docs/huggingface.md).
"""

from __future__ import annotations

import copy
import json
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .custom_generate import JACOBI_KEYS

CUSTOM_GENERATE_FILES = ("generate.py", "requirements.txt")

# Where the models load_model names come from (the model card's metadata).
_KNOWN_BASES = {
    None: "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-jf": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
_KNOWN_LICENSES = {
    None: "apache-2.0",
    "SmolLM2-135M-Instruct": "apache-2.0",
    "smollm2-jf": "apache-2.0",
}


@dataclass
class Measurement:
    """Decoding speed of the exported model on this machine (the model card's table)."""

    prompts: int
    max_new_tokens: int
    device: str = "cpu"
    rows: list[dict] = field(default_factory=list)  # method, tokens/forward, tokens/s, identical


def custom_generate_source() -> Path:
    """The shipped `custom_generate/` folder (jacobi_ext.CUSTOM_GENERATE / "custom_generate")."""
    return Path(__file__).resolve().parent / "custom_generate"


def plain_model(model):
    """A plain transformers model with `model`'s config and weights: a GGUF-loaded model refuses
    `save_pretrained` ("quantized with gguf"), and a merged peft model may carry peft state. The
    copy has no quantization_config and the source's dtype."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg._name_or_path = ""
    dtype = next(model.parameters()).dtype
    plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"cannot rebuild {type(model).__name__} from its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if getattr(cfg, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.eval()


def generation_config_for(model, tokenizer, settings: dict | None = None):
    """The model's generation config, greedy by default, with the tokenizer's special tokens where
    it has none, and our keys (JACOBI_KEYS names; `jacobi_method` always written)."""
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    gc = copy.deepcopy(base) if base is not None else GenerationConfig()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(gc, name, None) is None and tokenizer is not None:
            value = getattr(tokenizer, name, None)
            if value is not None:
                setattr(gc, name, value)
    if gc.pad_token_id is None and gc.eos_token_id is not None:
        eos = gc.eos_token_id
        gc.pad_token_id = eos if isinstance(eos, int) else eos[0]
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(JACOBI_KEYS))
    if unknown:
        raise ValueError(f"unknown settings {unknown}: expected some of {list(JACOBI_KEYS)}")
    settings.setdefault("jacobi_method", "multiblock")
    if settings.get("jacobi_block_size") is None:
        settings["jacobi_block_size"] = "auto"
    for key, value in settings.items():
        if value is not None:
            setattr(gc, key, value)
    gc._from_model_config = False  # written by hand: transformers must not regenerate it
    return gc


def measure(model, tokenizer, settings: dict, prompts: int = 3, max_new_tokens: int = 128):
    """Greedy AR against the folder's settings on the first `prompts` HumanEval problems: tokens
    per forward, tokens/s, and whether the outputs are identical (they must be)."""
    from ..data import humaneval_input_ids, load_humaneval
    from ..decoding import generate

    kw = {arg: settings[key] for key, arg in JACOBI_KEYS.items() if key in settings}
    if kw.get("block_size") == "auto":
        kw["block_size"] = None
    problems = load_humaneval(prompts)
    device = next(model.parameters()).device
    m = Measurement(prompts=len(problems), max_new_tokens=max_new_tokens, device=str(device))
    outs: dict[str, list] = {}
    for label, args in (("ar", {"method": "ar"}), (kw.get("method", "multiblock"), kw)):
        toks = fwd = 0
        secs = 0.0
        outs[label] = []
        ran: set[str] = set()
        for p in problems:
            ids = humaneval_input_ids(tokenizer, p).to(device)
            res = generate(model, ids, max_new_tokens=max_new_tokens, **args)
            toks += res.new_tokens
            fwd += res.forwards
            secs += res.seconds
            outs[label].append(res.tokens.tolist())
            ran.add(res.method)
        m.rows.append(
            {
                "method": label,
                "ran_as": ", ".join(sorted(ran)),
                "tokens_per_forward": toks / max(fwd, 1),
                "tokens_per_second": toks / secs if secs > 0 else float("nan"),
                "identical_to_ar": outs[label] == outs["ar"],
            }
        )
    return m


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _adapter_notes(readme: str, with_state: bool) -> str:
    """The adapter's own README as the card's "How it was distilled". The card is read by whoever
    holds the exported folder, without the repository: a first line says which paths are the
    repository's (and, `with_state`, that the adapter's train_state.json was copied into the
    folder), the README's title goes, and so does its paragraph on loading the adapter's own
    folder (it names `<this folder>`), which this folder, the adapter merged, is not."""
    body = readme.strip().splitlines()
    if body and body[0].startswith("# "):
        body = body[1:]
    paragraphs = [p for p in "\n".join(body).strip().split("\n\n") if "<this folder>" not in p]
    state = "\n`train_state.json` (copied here) holds its training settings;" if with_state else ""
    where = (
        f"*The notes of the LoRA adapter merged into these weights.{state}\npaths under `docs/` "
        "and `python_training/` are files of the jacobi_ext source repository, not of this "
        "folder.*"
    )
    return "\n\n".join([where, *paragraphs])


def _card(
    source: str | None,
    gc,
    model,
    adapter_notes: str | None,
    measured: Measurement | None,
) -> str:
    from .._version import __version__

    base = _KNOWN_BASES.get(source)
    license_ = _KNOWN_LICENSES.get(source)
    meta = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if license_:
        meta.append(f"license: {license_}")
    if base:
        meta.append(f"base_model: {base}")
    meta += ["tags:", "- custom_generate", "- jacobi-forcing", "- parallel-decoding", "---", ""]
    name = source or "SmolLM2-135M-Instruct"
    n_params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    keys = "\n".join(
        f"| `{k}` | `{json.dumps(getattr(gc, k))}` |" for k in JACOBI_KEYS if hasattr(gc, k)
    )
    base_note = f"\n(base model: [{base}](https://huggingface.co/{base}))" if base else ""
    text = f"""# {name}, decoding with Jacobi Forcing

A {model.config.model_type} causal LM ({n_params / 1e6:.1f} M parameters, {dtype}) exported by
`jacobi-forcing export` (jacobi_ext {__version__}) from `{name}`{base_note}. Its `generate` is
**lossless parallel decoding**: the model drafts blocks of tokens and refines them by Jacobi
(fixed-point) iteration, several blocks in flight, and commits a token only when it equals the
model's own greedy choice. The output is token for token what greedy decoding gives
(with `do_sample=True`, exactly autoregressive sampling under the same seed), in fewer
forward passes. It ships as a transformers
[custom generation method](https://huggingface.co/docs/transformers/generation_strategies#custom-generation-methods)
(`custom_generate/generate.py`), which calls the installed `jacobi_ext` (a compiled extension,
installed from its repository with `bash install.sh`; see `custom_generate/requirements.txt`).

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("THIS_FOLDER")
model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER", trust_remote_code=True)
ids = tok.apply_chat_template(
    [{{"role": "user", "content": "Write quicksort in Python."}}],
    add_generation_prompt=True, return_tensors="pt", return_dict=True,
)
out = model.generate(**ids, max_new_tokens=256)   # Jacobi decoding: greedy's tokens
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
```

- Without `trust_remote_code=True` (or with an explicit `generation_config=` argument to
  `from_pretrained`) the model decodes with transformers' own `generate`: same tokens, one
  forward per token.
- It takes what transformers' `generate` takes: a batch of left-padded prompts with its
  `attention_mask`, `streamer=` (each forward's committed tokens arrive together),
  `do_sample=True` with `temperature` / `top_k` / `top_p` / `min_p`,
  `return_dict_in_generate=True`.
- Refused with a `ValueError` (not lossless with these methods): `num_beams > 1`,
  repetition / n-gram penalties, `logits_processor`. Stopping criteria, stop strings (with
  `tokenizer=`) and `max_time` end an answer where transformers' own `generate` ends it.
- `JACOBI_EXT_GENERATE_LOG=/some/file` in the environment appends one JSON line a call: the
  method that ran, new tokens, forwards, tokens per forward, seconds.

## Serve

`pip install 'transformers[serving]'` (or jacobi_ext's `serve` extra), then
`transformers serve THIS_FOLDER --trust-remote-code` answers OpenAI's `/v1/chat/completions`
on port 8000, streaming or not, with this decoding:

```python
from openai import OpenAI

client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
messages = [{{"role": "user", "content": "Write quicksort in Python."}}]
reply = client.chat.completions.create(model="THIS_FOLDER", messages=messages, max_tokens=256)
print(reply.choices[0].message.content)
```

- Not `--continuous-batching`: that loop does not call `generate` (one token per forward).
- Greedy by default: a request's `temperature` / `top_p` alone do not sample. To sample, send
  a generation config: `extra_body={{"generation_config": json.dumps({{"do_sample": True,
  "temperature": 0.7, "max_new_tokens": 256}})}}` (and `seed=` for a reproducible sample).
- Refused options (`frequency_penalty`, `stop`, `logit_bias`) come back as HTTP 500, the
  `ValueError` in the server's log. Without `max_tokens` the server asks for 1024 new tokens.
- The first request loads the model and, with `jacobi_block_size: "auto"`, measures this
  machine's forward-time curve; later requests reuse both.

## Settings (`generation_config.json`)

| key | value |
|---|---|
{keys}

Each can be overridden per call as a keyword (`model.generate(ids, jacobi_method="jacobi",
jacobi_block_size=16)`). `jacobi_block_size: "auto"` picks the block size from a forward-time
curve measured once on the machine that runs it and the acceptance the model shows, and falls
back to plain autoregressive decoding (with context-lookup drafts) when parallel steps do not
pay there.
"""
    if adapter_notes:
        text += "\n## How it was distilled\n\n" + adapter_notes + "\n"
    if measured is not None and measured.rows:
        rows = "\n".join(
            f"| {r['method']} | {r['ran_as']} | {r['tokens_per_forward']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {'yes' if r['identical_to_ar'] else 'NO'} |"
            for r in measured.rows
        )
        ar = measured.rows[0]["tokens_per_second"]
        last = measured.rows[-1]["tokens_per_second"]
        text += f"""
## Measured at export

{measured.prompts} HumanEval prompts, {measured.max_new_tokens} new tokens each, greedy, on
{_device_name(measured.device)} ({torch.get_num_threads()} CPU threads), torch {torch.__version__}
(`jacobi-forcing export --measure {measured.prompts}`): {last / ar:.2f}x autoregressive decoding.

| settings | ran as | tokens per forward | tokens/s | identical to AR |
|---|---|---|---|---|
{rows}
"""
    return "\n".join(meta) + text


def export_model(
    model,
    tokenizer,
    out: str | Path,
    *,
    source: str | None = None,
    settings: dict | None = None,
    measure_prompts: int = 0,
    measure_new_tokens: int = 128,
    overwrite: bool = False,
) -> Path:
    """Write `model` (any transformers causal LM: GGUF-loaded, merged LoRA, plain) and its
    tokenizer as a Hugging Face folder whose `generate` is Jacobi decoding. `settings`: our
    generation_config keys (JACOBI_KEYS). `measure_prompts` > 0 measures AR against those settings
    on that many HumanEval prompts for the model card."""
    from ..models.quantized import is_quantized

    if is_quantized(model):
        raise ValueError(
            "this model decodes from a GGUF file's codes, which a Hugging Face folder cannot hold;"
            " load it with load_model(..., dequantize=True) to export it"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    plain = plain_model(model)
    gc = generation_config_for(model, tokenizer, settings)
    plain.generation_config = gc
    plain.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    cg = out / "custom_generate"
    cg.mkdir()
    for name in CUSTOM_GENERATE_FILES:
        shutil.copyfile(custom_generate_source() / name, cg / name)
    adapter_notes = None
    from ..models import ADAPTERS

    adapter = ADAPTERS.get(str(source)) if source is not None else None
    if adapter is None and source is not None and (Path(source) / "adapter_config.json").is_file():
        adapter = Path(source)
    if adapter is not None and (adapter / "README.md").is_file():
        # The adapter's notes (in the card) point at its training state: the folder carries it.
        with_state = (adapter / "train_state.json").is_file()
        if with_state:
            shutil.copyfile(adapter / "train_state.json", out / "train_state.json")
        readme = (adapter / "README.md").read_text(encoding="utf-8")
        adapter_notes = _adapter_notes(readme, with_state)
    measured = None
    if measure_prompts > 0:
        keys = {k: getattr(gc, k) for k in JACOBI_KEYS if getattr(gc, k, None) is not None}
        measured = measure(plain.to(device), tokenizer, keys, measure_prompts, measure_new_tokens)
    card = _card(source, gc, plain, adapter_notes, measured)
    (out / "README.md").write_text(card, encoding="utf-8")
    return out


def export(
    name_or_path: str | None,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    settings: dict | None = None,
    measure_prompts: int = 0,
    measure_new_tokens: int = 128,
    overwrite: bool = False,
) -> tuple[Path, float]:
    """Load `name_or_path` as `jacobi_ext.models.load_model` does (None: SmolLM2-135M-Instruct;
    "smollm2-jf": the shipped distillation, merged) and export it. Returns (folder, seconds)."""
    from ..models import load_model

    t0 = time.perf_counter()
    # A Hugging Face folder holds real weights: a GGUF base is dequantized, an adapter merged.
    model, tok = load_model(name_or_path, dtype=dtype, device=device, dequantize=True)
    path = export_model(
        model,
        tok,
        out,
        source=None if name_or_path is None else str(name_or_path),
        settings=settings,
        measure_prompts=measure_prompts,
        measure_new_tokens=measure_new_tokens,
        overwrite=overwrite,
    )
    return path, time.perf_counter() - t0
