"""The trainer on a tiny model: both losses go down, exact resume after an interrupt, gradient
checkpointing changes nothing, the saved checkpoint loads and decodes, and a 2-process gloo run
gives the loss of one process on the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from jacobi_ext.models import tiny_llama
from python_training import trainer as tr
from python_training.loss import example_loss
from python_training.prompts import Prompt
from python_training.trajectories import collect

V, EOS = 96, 3


def make_data(d: Path, k: int = 6) -> Path:
    model = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3)

    def encode(p):
        g = torch.Generator().manual_seed(int(p.id[1:]))
        return torch.randint(4, V, (1, 6), generator=g)

    ps = [Prompt(f"p{i}", text="x") for i in range(k)]
    collect(model, None, ps, d, block_size=4, max_new_tokens=16, progress=False, encode=encode)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("traj"))


def cfg(data_dir, out, **kw) -> tr.TrainConfig:
    base = dict(data=[str(data_dir)], out=str(out), window=4, lr=3e-3, warmup_ratio=0.0,
                max_steps=4, ar_weight=1.0, max_grad_norm=None)  # fmt: skip
    base.update(kw)
    return tr.TrainConfig(**base)


def test_finished_only_keeps_the_answers_that_reached_eos(tmp_path, monkeypatch):
    recs = [{"id": f"p{i}", "finished": i % 3 != 0, "blocks": [], "prompt_ids": []}
            for i in range(7)]  # fmt: skip
    monkeypatch.setattr(tr, "read_trajectories", lambda d: list(recs))
    c = cfg(tmp_path, tmp_path / "out")
    assert len(tr.load_examples(c)) == 7
    kept = tr.load_examples(cfg(tmp_path, tmp_path / "out", finished_only=True))
    assert [r["id"] for r in kept] == ["p1", "p2", "p4", "p5"]
    for r in recs:
        r["finished"] = False
    with pytest.raises(ValueError, match="reached EOS"):
        tr.load_examples(cfg(tmp_path, tmp_path / "out", finished_only=True))


def losses(model, c, n=6):
    model.eval()
    recs = tr.load_examples(c)
    with torch.no_grad():
        parts = [example_loss(model, tr.example_at(recs, c, i), 1.0) for i in range(n)]
    return sum(p.ar for p in parts) / n, sum(p.consistency for p in parts) / n


def test_few_steps_lower_both_losses(data_dir, tmp_path):
    c = cfg(data_dir, tmp_path / "run", max_steps=20, lr=1e-2, warmup_ratio=0.1)
    model = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    ar0, cons0 = losses(model, c)
    assert cons0 > 0
    tr.train(c, model=model, progress=False)
    ar1, cons1 = losses(model, c)
    assert ar1 < 0.8 * ar0, (ar0, ar1)
    assert cons1 < 0.8 * cons0, (cons0, cons1)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 21))
    # The saved checkpoint is a normal HF one: load_model + generate use it as is.
    from jacobi_ext.decoding import generate
    from jacobi_ext.models import load_model

    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors").exists()
    m2, _ = load_model(final) if (final / "tokenizer_config.json").exists() else (None, None)
    if m2 is None:
        from transformers import AutoModelForCausalLM

        m2 = AutoModelForCausalLM.from_pretrained(final, attn_implementation="sdpa").eval()
    for (n1, p1), (_, p2) in zip(model.named_parameters(), m2.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, msg=n1)
    ids = torch.randint(4, V, (1, 6))
    a = generate(m2, ids, method="ar", max_new_tokens=12).tokens
    b = generate(m2, ids, method="jacobi", block_size=4, max_new_tokens=12).tokens
    assert torch.equal(a, b)


def test_exact_resume_after_interrupt(data_dir, tmp_path, monkeypatch):
    kw = dict(max_steps=5, save_every=2, grad_accum=2)
    straight = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "a", **kw), model=straight, progress=False)

    real = tr.example_at

    def dies_in_step_4(records, c, gi):
        if gi >= 3 * 2:  # the first example of optimizer step 4 (G = 2)
            raise KeyboardInterrupt
        return real(records, c, gi)

    monkeypatch.setattr(tr, "example_at", dies_in_step_4)
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    with pytest.raises(KeyboardInterrupt):
        tr.train(cfg(data_dir, tmp_path / "b", **kw), model=m, progress=False)
    monkeypatch.setattr(tr, "example_at", real)
    assert (tmp_path / "b" / "checkpoints" / "step-2" / "DONE").exists()
    # A fresh process would rebuild the model from scratch: so do we (different init seed even).
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=99, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "b", **kw), model=m, progress=False)
    for (n1, p1), (_, p2) in zip(straight.named_parameters(), m.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0, msg=n1)
    la = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == [1, 2, 3, 3, 4, 5]  # step 3 logged, lost, redone
    assert [r["loss"] for r in la] == [r["loss"] for r in lb[:2] + lb[3:]]


def test_gradient_checkpointing_gives_the_same_step(data_dir, tmp_path):
    ms = []
    for gc in (False, True):
        m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
        tr.train(cfg(data_dir, tmp_path / f"gc{gc}", max_steps=2, gradient_checkpointing=gc),
                 model=m, progress=False)  # fmt: skip
        ms.append(m)
    for (n1, p1), (_, p2) in zip(ms[0].named_parameters(), ms[1].named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6, msg=n1)


def test_snapshots_do_not_perturb_training(tmp_path):
    """HF snapshots (for scaling curves) leave training bit-identical, with gradient
    checkpointing on (saving switches it off for the saved config)."""
    data = make_data(tmp_path / "traj", k=3)
    ms = []
    for snap in (0, 1):
        m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
        c = cfg(data, tmp_path / f"s{snap}", max_steps=2, snapshot_every=snap,
                gradient_checkpointing=True)  # fmt: skip
        tr.train(c, model=m, progress=False)
        ms.append(m)
    for (n1, p1), (_, p2) in zip(ms[0].named_parameters(), ms[1].named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0, msg=n1)
    snaps = sorted(p.name for p in (tmp_path / "s1" / "snapshots").iterdir())
    assert snaps == ["step-1", "step-2"]
    assert (tmp_path / "s1" / "snapshots" / "step-1" / "model.safetensors").exists()
    assert not (tmp_path / "s0" / "snapshots").exists()


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from jacobi_ext.models import tiny_llama
    from python_training import trainer as tr
    data, out, ga = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = tiny_llama(vocab_size=96, eos_token_id=3, seed=3, attn_implementation="jacobi")
    c = tr.TrainConfig(data=[data], out=out, window=4, lr=3e-3, warmup_ratio=0.0,
                       max_steps=3, grad_accum=ga, ar_weight=1.0)
    tr.train(c, model=m, progress=False)
    """
)


def free_port() -> int:
    """A TCP port that is free now: bound to port 0 (the OS picks one), read, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_two_process_gloo_matches_one_process(data_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the installed packages, not the checkout
    one = tmp_path / "one"
    subprocess.run([sys.executable, str(script), str(data_dir), str(one), "2"],
                   check=True, env=env, timeout=120)  # fmt: skip
    # A free port, never a fixed one (another run on the machine may hold it). Between closing
    # the probe and the launcher binding it, another process may take the port: then the launch
    # fails with "address already in use", and one more free port is tried.
    for attempt in range(3):
        two = tmp_path / f"two-{attempt}"
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script),
             str(data_dir), str(two), "1"],
            env=env, timeout=180, capture_output=True, text=True,
        )  # fmt: skip
        taken = r.returncode != 0 and ("address already in use" in r.stderr.lower()
                                       or "EADDRINUSE" in r.stderr)  # fmt: skip
        if not taken:
            break
    assert r.returncode == 0, r.stderr[-3000:]
    l1 = [json.loads(x) for x in (one / "log.jsonl").read_text().splitlines()]
    l2 = [json.loads(x) for x in (two / "log.jsonl").read_text().splitlines()]
    assert len(l1) == len(l2) == 3
    for a, b in zip(l1, l2, strict=True):
        # Step 1: the same global batch; steps 2-3: the same after identical (averaged) updates.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
        assert a["ar"] == pytest.approx(b["ar"], rel=1e-4)
        assert a["consistency"] == pytest.approx(b["consistency"], rel=1e-4)


def test_lora_trains_only_the_adapter_and_writes_it(data_dir, tmp_path):
    c = cfg(data_dir, tmp_path / "run", max_steps=20, lr=1e-2, warmup_ratio=0.1, lora_rank=4,
            save_every=10)  # fmt: skip
    model = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    ar0, cons0 = losses(model, c)
    tr.train(c, model=model, progress=False)
    ar1, cons1 = losses(model, c)
    assert ar1 < 0.9 * ar0 and cons1 < 0.9 * cons0, (ar0, ar1, cons0, cons1)
    ad = tmp_path / "run" / "adapter"
    state = json.loads((ad / tr.TRAIN_STATE).read_text())
    assert state["step"] == 20 and state["tokens"] > 0
    assert (ad / "adapter_model.safetensors").stat().st_size < 200_000
    # final/ is the merged model: equal to the untouched base + the adapter (so training moved
    # the adapter alone), and it decodes losslessly.
    from transformers import AutoModelForCausalLM

    from jacobi_ext.decoding import generate

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    fresh = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3)
    from peft import PeftModel

    ref = PeftModel.from_pretrained(fresh, str(ad)).merge_and_unload()
    for (n1, p1), (_, p2) in zip(ref.named_parameters(), merged.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, msg=n1)
    ids = torch.randint(4, V, (1, 6))
    a = generate(merged, ids, method="ar", max_new_tokens=12).tokens
    b = generate(merged, ids, method="jacobi", block_size=4, max_new_tokens=12).tokens
    assert torch.equal(a, b)


def test_kl_to_base_keeps_the_lora_model_closer_to_its_base(data_dir, tmp_path):
    # Same data, steps and seed; the run with the KL term ends nearer the base's distribution
    # at the AR positions (the quantity the term is for) and logs it every step.
    import torch.nn.functional as F

    from jacobi_ext.hf import jacobi_layout
    from python_training.packing import IGNORE

    base = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi").eval()

    def ar_logits(m, ex):
        with torch.no_grad(), jacobi_layout(ex.layout):
            out = m(input_ids=ex.input_ids[None], position_ids=ex.position_ids[None]).logits[0]
        return F.log_softmax(out[ex.ar_labels != IGNORE].double(), -1)

    def run(name, **kw):
        model = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
        c = cfg(data_dir, tmp_path / name, max_steps=12, lr=2e-2, lora_rank=4, **kw)
        tr.train(c, model=model, progress=False)
        model.eval()
        recs = tr.load_examples(c)
        kls = []
        for i in range(6):
            ex = tr.example_at(recs, c, i)
            logp, logq = ar_logits(base, ex), ar_logits(model, ex)
            kls.append(float((logp.exp() * (logp - logq)).sum(-1).mean()))
        log = [json.loads(x) for x in (tmp_path / name / "log.jsonl").read_text().split("\n") if x]
        return sum(kls) / len(kls), log

    kl_plain, log_plain = run("plain")
    kl_anchored, log_anchored = run("anchored", kl_weight=5.0)
    assert kl_anchored < 0.7 * kl_plain, (kl_plain, kl_anchored)
    assert "kl" not in log_plain[-1] and 0 <= log_anchored[-1]["kl"] < float("inf")
    with pytest.raises(ValueError, match="lora_rank"):
        cfg(data_dir, tmp_path / "full", kl_weight=1.0)


def test_lora_run_continues_from_its_committed_adapter(data_dir, tmp_path, monkeypatch):
    """A LoRA run goes on on a 'fresh machine': a new output folder with no checkpoints, only
    the adapter + train_state.json it wrote (what gets committed)."""
    kw = dict(max_steps=6, save_every=2, lora_rank=4, adapter_out=str(tmp_path / "repo_adapter"))
    real = tr.example_at

    def dies_in_step_4(records, c, gi):
        if gi >= 3:
            raise KeyboardInterrupt
        return real(records, c, gi)

    monkeypatch.setattr(tr, "example_at", dies_in_step_4)
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    with pytest.raises(KeyboardInterrupt):
        tr.train(cfg(data_dir, tmp_path / "a", **kw), model=m, progress=False)
    monkeypatch.setattr(tr, "example_at", real)
    st = json.loads((tmp_path / "repo_adapter" / tr.TRAIN_STATE).read_text())
    assert st["step"] == 2
    seen = []
    monkeypatch.setattr(tr, "example_at", lambda r, c, gi: seen.append(gi) or real(r, c, gi))
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    c = cfg(data_dir, tmp_path / "b", init_adapter=str(tmp_path / "repo_adapter"), **kw)
    tr.train(c, model=m, progress=False)
    assert seen == [2, 3, 4, 5]  # the data position went on where the adapter left it
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 4, 5, 6]
    assert log[0]["tokens_seen"] > st["tokens"]
    st = json.loads((tmp_path / "repo_adapter" / tr.TRAIN_STATE).read_text())
    assert st["step"] == 6
    with pytest.raises(FileNotFoundError, match="adapter"):
        tr.load_adapter_state(m, tmp_path)


def test_restart_schedule_keeps_weights_and_tokens_but_starts_data_and_lr_afresh(
    data_dir, tmp_path, monkeypatch
):
    """--restart-schedule: a new chunk from an annealed adapter (new prompts, a new cosine)
    starts at data position 0 and at the warm-up's first LR, from the adapter's weights, and its
    token count goes on from the adapter's."""
    from safetensors.torch import load_file

    kw = dict(max_steps=4, save_every=2, lora_rank=4, lr=1e-2)
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "a", **kw), model=m, progress=False)
    first = tmp_path / "a" / "adapter"
    st0 = json.loads((first / tr.TRAIN_STATE).read_text())
    w0 = load_file(str(first / "adapter_model.safetensors"))

    real = tr.example_at
    seen, loaded = [], []
    monkeypatch.setattr(tr, "example_at", lambda r, c, gi: seen.append(gi) or real(r, c, gi))
    real_load = tr.load_adapter_state

    def spy_load(model, d):
        out = real_load(model, d)
        # the weights the new run starts from are the adapter's, bit for bit
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(model)
        loaded.append(w0.keys() == live.keys() and all(torch.equal(w0[k], live[k]) for k in w0))
        return out

    monkeypatch.setattr(tr, "load_adapter_state", spy_load)
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    c = cfg(data_dir, tmp_path / "b", init_adapter=str(first), restart_schedule=True,
            warmup_ratio=0.25, **kw)  # fmt: skip
    tr.train(c, model=m, progress=False)
    assert loaded == [True]
    assert seen == [0, 1, 2, 3]  # data position 0, not the adapter's step 4
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert log[0]["tokens_seen"] == st0["tokens"] + log[0]["tokens"]
    # the LR schedule ran again from its start: the same LRs as a run from scratch
    fresh = tmp_path / "c"
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, fresh, warmup_ratio=0.25, **kw), model=m, progress=False)
    ref = [json.loads(x) for x in (fresh / "log.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in log] == [r["lr"] for r in ref]
    st = json.loads((tmp_path / "b" / "adapter" / tr.TRAIN_STATE).read_text())
    assert st["step"] == 4 and st["tokens"] == log[-1]["tokens_seen"]
    with pytest.raises(ValueError, match="init_adapter"):
        cfg(data_dir, tmp_path / "d", restart_schedule=True, **kw)


def test_rerun_on_a_fresh_machine_goes_on_from_its_own_adapter_not_init_adapter(data_dir, tmp_path):
    """A chunk started from --init-adapter (with --restart-schedule) commits its adapter; the
    same command on a machine without its checkpoints goes on from that committed adapter, not
    over again from init_adapter."""
    import shutil

    kw = dict(save_every=2, lora_rank=4, lr=1e-2)
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "a", max_steps=4, **kw), model=m, progress=False)
    first = str(tmp_path / "a" / "adapter")
    chunk = dict(init_adapter=first, restart_schedule=True, adapter_out=str(tmp_path / "ad"))
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "b", max_steps=4, **chunk, **kw), model=m, progress=False)
    st1 = json.loads((tmp_path / "ad" / tr.TRAIN_STATE).read_text())
    assert st1["step"] == 4
    shutil.rmtree(tmp_path / "b")  # a fresh machine: only the committed adapter is there
    m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
    tr.train(cfg(data_dir, tmp_path / "b", max_steps=4, **chunk, **kw), model=m, progress=False)
    log = tmp_path / "b" / "log.jsonl"
    assert not log.exists() or not log.read_text().strip()  # nothing left to do: no step again
    st2 = json.loads((tmp_path / "ad" / tr.TRAIN_STATE).read_text())
    assert (st2["step"], st2["tokens"]) == (4, st1["tokens"])  # not init_adapter's count + 4 steps


def test_bf16_lora_frozen_weight_copies_change_no_number(data_dir, tmp_path, monkeypatch):
    """The bf16 copies of the frozen base weights are a pure speed-up: a bf16 LoRA run with and
    without them writes the same adapter bit for bit, and the merged final/ is base (fp32,
    untouched) + adapter."""
    kw = dict(max_steps=4, lr=1e-2, lora_rank=4, mixed_precision="bf16")

    def run(name):
        m = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3, attn_implementation="jacobi")
        tr.train(cfg(data_dir, tmp_path / name, **kw), model=m, progress=False)
        from safetensors.torch import load_file

        return load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors"))

    patched = []
    real = tr.FrozenLinearsBF16.__init__

    def spy(self, model):
        real(self, model)
        patched.append(len(self.patched))

    monkeypatch.setattr(tr.FrozenLinearsBF16, "__init__", spy)
    with_copies = run("with")
    assert patched and patched[0] == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    monkeypatch.setattr(tr.FrozenLinearsBF16, "__init__", lambda self, model: setattr(
        self, "patched", []))  # fmt: skip
    without = run("without")
    assert with_copies.keys() == without.keys()
    for k in with_copies:
        assert torch.equal(with_copies[k], without[k]), k
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "with" / "final")
    fresh = tiny_llama(vocab_size=V, eos_token_id=EOS, seed=3)
    ref = PeftModel.from_pretrained(fresh, str(tmp_path / "with" / "adapter")).merge_and_unload()
    for (n1, p1), (_, p2) in zip(ref.named_parameters(), merged.named_parameters(), strict=True):
        assert p2.dtype == torch.float32
        torch.testing.assert_close(p1, p2, msg=n1)
