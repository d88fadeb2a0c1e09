"""`jacobi-forcing export` (issue 37 §2) and `transformers serve` in front of the exported folder
(§3), with a tiny random model and a tiny offline tokenizer; the real model only under `slow`."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers
from hf_fixtures import tiny_chat_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import jacobi_ext
from jacobi_ext.apps.cli import main as cli_main
from jacobi_ext.hf.export import export_model

SETTINGS = {"jacobi_method": "multiblock", "jacobi_block_size": 4}
CHAT = [{"role": "user", "content": "Write a haiku about parallel decoding."}]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    model, tok = tiny_chat_model(dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny_export") / "model"
    return export_model(model, tok, out, source="tiny-test", settings=SETTINGS)


def _chat_ids(tok):
    return tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)  # fmt: skip


def test_folder_layout(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md",
            "tokenizer.json", "tokenizer_config.json", "custom_generate"} <= names  # fmt: skip
    assert sorted(p.name for p in (exported / "custom_generate").iterdir()) == [
        "generate.py",
        "requirements.txt",
    ]
    gc = json.loads((exported / "generation_config.json").read_text())
    assert gc["jacobi_method"] == "multiblock" and gc["jacobi_block_size"] == 4
    assert gc["eos_token_id"] == 2 and gc["pad_token_id"] == 0
    card = (exported / "README.md").read_text()
    assert card.startswith("---\n") and "- custom_generate" in card
    assert "jacobi_block_size" in card and "trust_remote_code=True" in card
    assert "quantization_config" not in (exported / "config.json").read_text()


def test_from_pretrained_generate_is_jacobi(exported, tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("JACOBI_EXT_GENERATE_LOG", str(log))
    tok = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    enc = _chat_ids(tok)
    ids = enc["input_ids"]
    positional = model.generate(ids, max_new_tokens=40)
    keyword = model.generate(input_ids=ids, max_new_tokens=40)
    ours = jacobi_ext.generate(model, ids, max_new_tokens=40, method="multiblock", block_size=4)
    assert torch.equal(positional, keyword)
    assert torch.equal(positional[0, ids.shape[1] :], ours.tokens[0])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 and all(c["method"].startswith("multiblock") for c in calls)
    # lossless: transformers' own generate on the same weights gives the same tokens
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert torch.equal(plain.generate(ids, max_new_tokens=40, do_sample=False), positional)


def test_explicit_generation_config_falls_back_to_transformers(exported, tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("JACOBI_EXT_GENERATE_LOG", str(log))
    model = AutoModelForCausalLM.from_pretrained(
        exported, trust_remote_code=True, generation_config=GenerationConfig(max_new_tokens=9)
    )
    ids = _chat_ids(AutoTokenizer.from_pretrained(exported))["input_ids"]
    out = model.generate(ids, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 9
    assert not log.exists()  # transformers' own generate ran, not ours


def test_card_resolves_in_the_folder(exported, tmp_path):
    """The model card is read by whoever holds the exported folder, without the repository:
    its links and the files it names are in the folder. An adapter's notes come in with the
    adapter's train_state.json (which they cite), a line saying which paths are the source
    repository's, and without their paragraph on loading the adapter folder itself."""
    import re
    import shutil

    from test_docs_links import relative_links

    from jacobi_ext.models import ADAPTERS, DISTILLED_MODEL

    shipped = ADAPTERS[DISTILLED_MODEL]
    adapter = tmp_path / "adapter"  # the shipped notes, beside a config that marks an adapter
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for name in ("README.md", "train_state.json"):
        shutil.copyfile(shipped / name, adapter / name)
    model, tok = tiny_chat_model(dtype=torch.float32)
    distilled = export_model(model, tok, tmp_path / "out", source=str(adapter), settings=SETTINGS)
    assert not (exported / "train_state.json").exists()  # no adapter: no notes, no state
    assert "How it was distilled" not in (exported / "README.md").read_text()
    assert (distilled / "train_state.json").read_bytes() == (
        adapter / "train_state.json"
    ).read_bytes()
    for folder in (exported, distilled):
        card = (folder / "README.md").read_text()
        assert all((folder / link).exists() for link in relative_links(card)), folder
        own, _, notes = card.partition("## How it was distilled")
        named = re.findall(r"`([\w./-]+\.(?:json|py|txt|md|safetensors))`", own)
        assert {"custom_generate/generate.py", "generation_config.json"} <= set(named)
        assert all((folder / name).exists() for name in named), named
        assert "docs/huggingface.md" not in card
    assert "`train_state.json` (copied here)" in notes and "source repository" in notes
    body = (adapter / "README.md").read_text().strip().split("\n\n")[1:]  # below the title
    assert all(para in notes for para in body if "<this folder>" not in para)
    assert "<this folder>" not in notes
    assert "transformers serve THIS_FOLDER --trust-remote-code" in own
    assert "OpenAI(base_url=" in own  # how to call the server, in the card itself


def test_cli_export(tmp_path, capsys):
    model, tok = tiny_chat_model(dtype=torch.float32, family="qwen2")
    src = tmp_path / "src"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp_path / "out"
    args = ["export", "--model", str(src), "--out", str(out), "--method", "jacobi",
            "--block-size", "6", "--no-lookup"]  # fmt: skip
    assert cli_main(args) == 0
    assert "wrote" in capsys.readouterr().out
    gc = json.loads((out / "generation_config.json").read_text())
    keys = (gc["jacobi_method"], gc["jacobi_block_size"], gc["jacobi_lookup"])
    assert keys == ("jacobi", 6, False)
    assert "jacobi_num_blocks" not in gc  # unset: the engine's default
    assert cli_main(args) == 1  # the folder is not empty: refused without --force
    assert "--force" in capsys.readouterr().err
    assert cli_main([*args, "--force"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.randint(3, 99, (1, 7))
    ref = jacobi_ext.generate(loaded, ids, max_new_tokens=20, method="jacobi", block_size=6)
    assert torch.equal(loaded.generate(ids, max_new_tokens=20)[0, 7:], ref.tokens[0])


# --- transformers serve -------------------------------------------------------------------

SERVE_MISSING = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _older_server() -> bool:
    """transformers 5.0's `serve`: told its model with `--force-model` (5.25: a positional
    FORCE_MODEL), streams through a TextIteratorStreamer, and passes no tokenizer to `generate`,
    so transformers' own generate refuses a request's `stop` there too. Read off its help."""
    cli = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--help"]
    usage = subprocess.run(cli, capture_output=True, text=True, timeout=120).stdout
    return "--force-model" in usage


@contextlib.contextmanager
def _server(folder: Path, env: dict):
    port = _free_port()
    cmd = [
        sys.executable, "-m", "transformers.cli.transformers", "serve",
        *(["--force-model", str(folder)] if _older_server() else [str(folder)]),
        "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited ({proc.returncode}):\n{proc.stdout.read()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("server did not answer /health in 120 s") from None
                time.sleep(0.2)
        yield port, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        else:
            out = proc.stdout.read()
        log.append(out)


@pytest.mark.skipif(
    bool(SERVE_MISSING),
    reason=f"transformers serve needs {', '.join(SERVE_MISSING)}: pip install 'jacobi_ext[serve]'",
)
def test_transformers_serve_openai_client(exported, tmp_path):
    """Plain and streamed chat completions give transformers' greedy answer, and a request's
    `stop` ends it where transformers' generate ends it with those stop strings. transformers
    5.25 passes `stopping_criteria=[stop_if_cancelled]` to every plain request: it is honoured."""
    from openai import OpenAI

    version = f"transformers {transformers.__version__}"  # failures name the version they met
    calls = tmp_path / "calls.jsonl"
    env = dict(os.environ, JACOBI_EXT_GENERATE_LOG=str(calls), HF_HUB_OFFLINE="1")
    tok = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    enc = _chat_ids(tok)
    P = enc["input_ids"].shape[1]
    n_new = 48
    want_ids = model.generate(**enc, max_new_tokens=n_new)[0, P:]
    want = tok.decode(want_ids, skip_special_tokens=True)
    assert len(want) > 12
    stop = want[8:10]  # a stop string the answer meets: serve passes it as stop_strings
    plain = AutoModelForCausalLM.from_pretrained(exported)  # transformers' own generate
    stopped_ids = plain.generate(**enc, max_new_tokens=n_new, stop_strings=[stop],
                                 tokenizer=tok)[0, P:]  # fmt: skip
    assert len(stopped_ids) < len(want_ids)
    calls.unlink(missing_ok=True)  # the reference calls above are logged too

    with _server(exported, env) as (port, log):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        t0 = time.perf_counter()
        try:
            reply = client.chat.completions.create(
                model=str(exported), messages=CHAT, max_tokens=n_new, timeout=120
            )
        except Exception as e:  # e.g. HTTP 400 from an argument a new transformers passes
            raise AssertionError(f"{version}: plain request failed: {e}") from e
        t_plain = time.perf_counter() - t0
        assert reply.choices[0].message.content == want, version
        if reply.usage is not None:  # 5.0's server reports no usage
            assert reply.usage.completion_tokens == len(want_ids), version
        t0 = time.perf_counter()
        chunks = client.chat.completions.create(
            model=str(exported), messages=CHAT, max_tokens=n_new, stream=True, timeout=120
        )
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        t_stream = time.perf_counter() - t0
        assert "".join(pieces) == want, version
        # It did stream: 5.25's server sends each token's text, 5.0's (TextIteratorStreamer) whole
        # words, so one piece is all an answer of one word can give there.
        assert sum(1 for p in pieces if p) > 1 or len(want.split()) == 1, (version, pieces)
        if _older_server():  # no tokenizer reaches generate: `stop` fails on any model there
            stopped = streamed_stop = None
        else:
            stopped = client.chat.completions.create(
                model=str(exported), messages=CHAT, max_tokens=n_new, stop=[stop], timeout=120
            )
            streamed_stop = client.chat.completions.create(
                model=str(exported), messages=CHAT, max_tokens=n_new, stop=[stop], stream=True,
                timeout=120,
            )  # fmt: skip
        if stopped is not None:
            text = stopped.choices[0].message.content
            ref = tok.decode(stopped_ids, skip_special_tokens=True)
            assert text in (ref, ref.removesuffix(stop)), (version, text)
            streamed = "".join(c.choices[0].delta.content or "" for c in streamed_stop if c.choices)
            assert streamed == text, version
    out = log[0]
    assert "Application shutdown complete" in out and "Finished server process" in out
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # Every answer came from our decoding (one JSON line per generate call).
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(records) == (2 if stopped is None else 4), records
    assert all(r["method"].startswith("multiblock") for r in records)
    print(f"serve ({version}): non-streaming {t_plain * 1e3:.0f} ms, streaming "
          f"{t_stream * 1e3:.0f} ms")  # fmt: skip


# --- the real model ------------------------------------------------------------------------


@pytest.mark.slow
def test_export_default_gguf_model(tmp_path):
    """The default model is loaded from GGUF (dequantized: a folder holds real weights), which
    refuses save_pretrained: the export rebuilds a plain model. The folder decodes the same
    tokens as load_model's model; a model on the file's codes is refused with what to do."""
    from jacobi_ext.models import load_model

    codes, _ = load_model()
    with pytest.raises(ValueError, match="dequantize=True"):
        export_model(codes, _, tmp_path / "codes")
    del codes
    ref_model, tok = load_model(dequantize=True)
    t0 = time.perf_counter()
    path = export_model(ref_model, tok, tmp_path / "smollm2", settings={"jacobi_block_size": 8})
    print(f"export of SmolLM2-135M-Instruct (after its load): {time.perf_counter() - t0:.1f} s")
    assert (path / "model.safetensors").stat().st_size > 400e6  # fp32, tied head once
    ids = _chat_ids(tok)["input_ids"]
    ref = jacobi_ext.generate(ref_model, ids, max_new_tokens=48, method="multiblock", block_size=8)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    out = model.generate(ids, max_new_tokens=48)
    assert torch.equal(out[0, ids.shape[1] :], ref.tokens[0])
