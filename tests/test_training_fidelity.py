"""`fidelity`: the base's greedy answers teacher-forced through a model. Checked against first
principles on tiny random Llamas (float64): the base scores its own answers perfectly; for another
model, ``prefix`` is exactly how many tokens that model's own greedy answer shares with the base's,
and ``agreement`` / ``nll`` equal a token-by-token recomputation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from jacobi_ext.models import tiny_llama
from python_training import evaluate, fidelity

VOCAB, NEW = 64, 12


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy by full re-forwards (no cache): the independent reference."""
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(t)
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return out


@pytest.fixture()
def setup(monkeypatch):
    base = tiny_llama(vocab_size=VOCAB, seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    probs = [{"task_id": f"T/{i}", "input_ids": torch.randint(3, VOCAB, (1, 5 + i), generator=g)}
             for i in range(5)]  # fmt: skip
    monkeypatch.setattr(evaluate, "_problems", lambda prompts, tok: probs)
    rows = [{"task_id": p["task_id"], "method": "greedy",
             "token_ids": greedy(base, p["input_ids"], NEW)} for p in probs]  # fmt: skip
    return base, probs, rows


def test_base_scores_its_own_answers_perfectly(setup):
    base, _, rows = setup
    out = fidelity.fidelity(base, None, rows, progress=False)
    s = out["summary"]
    assert s["agreement"] == 1.0 and s["identical"] == 1.0
    assert s["median_prefix"] == NEW and s["tokens"] == NEW * len(rows)
    assert all(t["prefix"] == NEW for t in out["tasks"].values())


def test_prefix_is_the_shared_greedy_prefix_and_scores_match_a_recomputation(setup):
    _, probs, rows = setup
    other = tiny_llama(vocab_size=VOCAB, seed=4, dtype=torch.float64)
    out = fidelity.fidelity(other, None, rows, progress=False)
    hits = nll = 0.0
    for p, r in zip(probs, rows, strict=True):
        own = greedy(other, p["input_ids"], NEW)
        pairs = enumerate(zip(own, r["token_ids"], strict=True))
        shared = next((i for i, (a, b) in pairs if a != b), NEW)
        t = out["tasks"][p["task_id"]]
        assert t["prefix"] == shared
        assert t["identical"] == (own == r["token_ids"])
        ids = p["input_ids"]
        for tok in r["token_ids"]:  # token by token, no batching over positions
            with torch.no_grad():
                logp = torch.log_softmax(other(input_ids=ids).logits[0, -1], -1)
            hits += float(int(logp.argmax()) == tok)
            nll -= float(logp[tok])
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    n = NEW * len(rows)
    assert out["summary"]["agreement"] == pytest.approx(hits / n)
    assert out["summary"]["nll"] == pytest.approx(nll / n, rel=1e-9)
    assert out["summary"]["agreement"] < 1.0  # two random models do disagree
    assert math.isfinite(out["summary"]["nll"])


def test_bad_references_are_clear_errors(setup, tmp_path):
    base, _, rows = setup
    with pytest.raises(ValueError, match="not in the 'humaneval' prompts"):
        fidelity.fidelity(base, None, [{**rows[0], "task_id": "elsewhere/1"}], progress=False)
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"task_id": "T/0", "method": "jacobi", "token_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="no 'greedy' rows"):
        fidelity.reference_rows(f)
    assert fidelity.reference_rows(f, "jacobi")[0]["token_ids"] == [1]
