"""The vLLM proposer's next drafts are the engine's: one rule (jacobi_ext/decoding/next_draft.py)
that the engine's reference step calls and that jacobi_vllm loads by file, without importing
jacobi_ext. No vLLM needed: the proposer is driven here with the records vLLM's wrapped sampler
would hand it, and its drafts are compared with the reference step's main row, step by step."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("jacobi_vllm") is None:  # a checkout not installed: its folder, last
    sys.path.append(str(ROOT))
RULE_FILES = [ROOT / "jacobi_ext/decoding/next_draft.py", ROOT / "jacobi_ext/decoding/lookup.py"]


def _engine():
    """jacobi_ext's reference step, or a skip where jacobi_ext is not installed (vLLM's own
    environment runs these tests too, without it)."""
    try:
        from jacobi_ext.decoding import next_draft, reference
    except ImportError as exc:
        pytest.skip(f"the engine's reference needs jacobi_ext installed ({exc.__class__.__name__})")
    return next_draft, reference


def _env_with_root() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_rule_files_import_only_the_standard_library(path):
    """Loaded by path inside vLLM's worker: no relative imports, nothing outside the stdlib."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module == "__future__", ast.dump(node)
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
            assert all(n in sys.stdlib_module_names for n in names), names


def test_loading_the_rule_does_not_import_jacobi_ext():
    code = (
        "import sys, json; from jacobi_vllm import _rules; import jacobi_vllm.proposer; "
        "print(json.dumps([_rules.next_draft.__file__, sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('jacobi_ext', 'vllm', 'torch'))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env_with_root()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path, loaded = json.loads(out.stdout)
    assert Path(path).name == "next_draft.py"
    assert loaded == [], f"importing jacobi_vllm pulled in {loaded}"


def test_reference_calls_the_shared_rule():
    next_draft, reference = _engine()
    from jacobi_vllm import _rules

    assert reference.next_main_row is next_draft.next_main_row
    assert reference.accepted_length is next_draft.accepted_length
    assert Path(_rules.next_draft.__file__).read_bytes() == Path(next_draft.__file__).read_bytes()


# ---- the proposer against the reference step, without vLLM ------------------------------------


def _model(vocab: int, seed: int):
    """A deterministic 'model': the next token is a function of the last two (repetitive, so
    drafts get accepted at varied lengths)."""
    rng = random.Random(seed)
    table = {(i, j): rng.randrange(vocab) for i in range(vocab) for j in range(vocab)}
    return lambda seq: table[(seq[-2], seq[-1])]


def _proposer(n: int, K: int, ratio: float):
    from jacobi_vllm import hook, proposer

    cfg = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=n * K - 1),
        additional_config={"jacobi": {"num_blocks": K, "block_size": n, "lookup": "off",
                                      "activation_ratio": ratio}},
        model_config=types.SimpleNamespace(max_model_len=10_000),
    )  # fmt: skip
    orig = hook.install
    hook.install = lambda **kw: True  # no vLLM here: records are handed in by the test
    try:
        p = proposer.JacobiProposer(cfg)
    finally:
        hook.install = orig
    return p


@pytest.mark.parametrize("n,K,ratio", [(4, 1, 0.85), (6, 1, 0.5), (4, 2, 0.5), (5, 3, 0.85)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proposer_drafts_are_the_reference_main_row(n, K, ratio, seed):
    import math

    np = pytest.importorskip("numpy")
    verify_step = _engine()[1].verify_step
    from jacobi_vllm import hook

    vocab, steps = 6, 40
    nxt = _model(vocab, seed)
    prompt = [random.Random(seed).randrange(vocab) for _ in range(8)]
    c = prompt[0]
    p = _proposer(n, K, ratio)

    class _Rng:  # context tokens for a new block: always position 0, so both sides agree
        def randrange(self, k):
            return 0

    p._rng_for = lambda rid: _Rng()

    # vLLM's side: the committed tokens, one record per step
    vctx = list(prompt)
    sampled = [nxt(vctx)]  # the prefill step
    rec = hook.StepRecord(1, ["r0"], [[]], [sampled[:]])
    vctx += sampled
    # the reference's side: main row = seed + drafts, after the same prefill
    ref_ctx = list(prompt)
    main_row, ends = [vctx[-1]] + [c] * (n - 1), [n]
    thr = math.ceil(ratio * n)
    for step in range(steps):
        hook.STATE.last, hook.STATE.broken = rec, None
        tok = np.zeros((1, 1000), dtype=np.int64)
        tok[0, : len(vctx)] = vctx
        (draft,) = p.propose([sampled], np.array([len(vctx)]), tok)
        assert [vctx[-1], *draft] == main_row, f"step {step}"
        # verify the row as vLLM would: greedy along the row, accept, commit
        row = [vctx[-1], *draft]
        greedy = [nxt(vctx + row[1 : i + 1]) for i in range(len(row))]
        a = 1
        while a < len(row) and row[a] == greedy[a - 1]:
            a += 1
        sampled = row[1:a] + [greedy[a - 1]]
        rec = hook.StepRecord(step + 2, ["r0"], [draft], [greedy])
        vctx += sampled
        # the reference step on the same row
        ref_greedy = [nxt(ref_ctx + main_row[: i + 1]) for i in range(len(main_row))]
        init = [main_row[0]] + [c] * (n - 1)
        res = verify_step([main_row], [ref_greedy], ends, init, [], 0, n, K, spawn_threshold=thr)
        assert res.accepted == a
        ref_ctx += res.commit
        main_row, ends = res.next_tokens, res.next_block_ends
        assert ref_ctx + [main_row[0]] == vctx


@pytest.mark.parametrize("lookup_wins", [True, False])
def test_auto_lookup_replaces_the_tail_when_it_has_been_accepted_longer(lookup_wins):
    """One chain a request: a lookup continuation takes the tail's place for a step where
    lookups after a match of that length have been accepted longer than tails."""
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook

    p = _proposer(8, 1, 0.85)
    p.lookup = "auto"
    p.accepted = {"jacobi": [1.0, 10.0], 3: [30.0 if lookup_wins else 0.0, 10.0]}  # per step
    # The step just verified: seed 2, drafts [5, 0, ...]; 5 accepted, then the model said 7.
    # The context now ends in 2 5 7, which occurred before, followed by 9 9 4 3 8 2 5.
    ctx = [1, 2, 5, 7, 9, 9, 4, 3, 8, 2, 5, 7]
    verified = [5, 0, 0, 0, 0, 0, 0]
    greedy = [5, 7, 11, 12, 13, 14, 15, 16]
    sampled = [5, 7]
    hook.STATE.last, hook.STATE.broken = hook.StepRecord(5, ["r"], [verified], [greedy]), None
    p.reqs.clear()
    tok = np.zeros((1, 64), dtype=np.int64)
    tok[0, : len(ctx)] = ctx
    (draft,) = p.propose([sampled], np.array([len(ctx)]), tok)
    tail = greedy[2:-1]  # the model's own predictions after the accepted prefix
    if lookup_wins:
        assert draft == [9, 9, 4, 3, 8, 2, 5]  # what followed 2 5 7 last time
    else:
        assert draft == tail


@pytest.mark.parametrize("tails_pay", [True, False])
def test_min_tail_accept_proposes_nothing_where_drafts_would_not_pay(tails_pay):
    """min_tail_accept (a CPU's setting): a Jacobi tail is proposed only while tails have been
    accepted at least that many drafts a step; otherwise the step proposes nothing (a one-token
    forward), and a new block without a lookup match (context tokens) is not proposed either. A
    lookup continuation still is."""
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook

    p = _proposer(8, 1, 0.85)
    p.min_tail_accept = 0.5
    p.accepted = {"jacobi": [6.0 if tails_pay else 1.0, 10.0]}

    def propose(ctx, verified, greedy, sampled, rid="r"):
        hook.STATE.last = hook.StepRecord(5, [rid], [verified], [greedy])
        hook.STATE.broken = None
        tok = np.zeros((1, 64), dtype=np.int64)
        tok[0, : len(ctx)] = ctx
        return p.propose([sampled], np.array([len(ctx)]), tok)[0]

    # a tail left after the step: 5 accepted, then the model said 7
    ctx = [1, 2, 3, 4, 2, 5, 7]
    verified, greedy = [5, 0, 0, 0, 0, 0, 0], [5, 7, 11, 12, 13, 14, 15, 16]
    draft = propose(ctx, verified, greedy, [5, 7])
    assert draft == (greedy[2:-1] if tails_pay else [])
    # every draft accepted: a new block, from context tokens (lookup "off")
    p.reqs.clear()
    row = [8, 9, 10, 11, 12, 13, 14]
    draft = propose([1, 2, 3, 4, 2, *row, 15], row, [*row, 15, 16], [*row, 15], rid="s")
    assert len(draft) == (7 if tails_pay else 0)
    # with a lookup match a new block is proposed whatever the tails did: the continuation
    p.lookup = "spawn"
    p.reqs.clear()
    ctx = [2, 5, 7, 9, 9, 4, 3, 8, 1, 6, 2, 5, 7]
    draft = propose(ctx, [5], [5, 7], [5, 7], rid="t")
    assert draft[:5] == [9, 9, 4, 3, 8]


# ---- cost_aware: drafts cut to the length that pays ---------------------------------------------


def test_step_clock_learns_the_step_time_per_width():
    from jacobi_vllm.proposer import StepClock

    c = StepClock(prior_slope=0.1)
    assert c.time(4) is None and c.ratio(4, 1) == pytest.approx(1.3)  # the prior alone
    c.step_starts(10.0, 1)
    c.step_ended(10.05)  # one step verifying 1 token: 50 ms
    assert c.ratio(5, 1) == pytest.approx(1.4)  # one width timed: the prior's slope
    for t in (0.09, 0.5, 0.09):  # width 5: the median, not the outlier (a prefill in the step)
        c.step_starts(0.0, 5)
        c.step_ended(t)
    assert c.time(5) == pytest.approx(0.09)
    assert c.time(3) == pytest.approx(0.07)  # between widths: linear
    assert c.time(9) == pytest.approx(0.13)  # beyond: the last two's slope
    c.step_starts(0.0, 7)
    c.step_ended(0.06)  # a wider step timed faster: the curve stays non-decreasing
    assert c.time(7) == pytest.approx(0.09) and c.time(6) == pytest.approx(0.09)
    c.step_ended(99.0)  # no step under way (nothing proposed): nothing recorded
    assert sum(len(v) for v in c.times.values()) == 5


@pytest.mark.parametrize("per_token,want", [(0.01, 6), (0.3, 1), (1.0, 0)])
def test_cost_aware_cuts_the_tail_to_the_length_that_pays(per_token, want):
    """With per-draft acceptance ~0.6 the tail is proposed whole where a verified token costs 1 %
    of a step, cut to one draft where it costs 30 % (the engine's LookupPolicy: 1 + E[accepted]
    per unit of time is highest there), and not at all where it costs a whole step."""
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook

    p = _proposer(8, 1, 0.85)
    p.cost_aware = True
    for w in (1, 2, 4, 8):  # vLLM's step: 1 + per_token per extra verified token
        for _ in range(3):
            p.clock.step_starts(0.0, w)
            p.clock.step_ended(1.0 + per_token * (w - 1))
    p.tail_policy.accepted[1], p.tail_policy.rejected[1] = 6.0, 4.0  # 0.6 a draft (then 7/12)
    ctx = [1, 2, 3, 4, 2, 5, 7]  # no earlier 7: no lookup match
    verified, greedy = [5, 0, 0, 0, 0, 0, 0], [5, 7, 11, 12, 13, 14, 15, 16]
    hook.STATE.last, hook.STATE.broken = hook.StepRecord(5, ["r"], [verified], [greedy]), None
    st = p._state("r", ctx)  # the step just verified was a Jacobi row of 8 (seed + 7 drafts)
    st.source, st.main_len, st.block_ends = "jacobi", 8, [8]
    tok = np.zeros((1, 64), dtype=np.int64)
    tok[0, : len(ctx)] = ctx
    (draft,) = p.propose([[5, 7]], np.array([len(ctx)]), tok)
    # it accepted one draft of 7 (5), then missed: the tail policy learnt that first
    assert p.tail_policy.accepted[1] == 7.0 and p.tail_policy.rejected[1] == 5.0
    assert draft == greedy[2:-1][:want]  # the model's tail, cut


def test_cost_aware_takes_the_lookup_where_lookups_pay_more():
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook

    p = _proposer(8, 1, 0.85)
    p.cost_aware, p.lookup = True, "auto"
    p.tail_policy.accepted[1], p.tail_policy.rejected[1] = 0.2, 9.8  # tails rarely accepted
    p.lookup_policy.accepted[3], p.lookup_policy.rejected[3] = 9.0, 1.0  # lookups after 3: 0.9
    ctx = [1, 2, 5, 7, 9, 9, 4, 3, 8, 2, 5, 7]  # 2 5 7 occurred before, then 9 9 4 3 8 2 5
    verified, greedy = [5, 0, 0, 0, 0, 0, 0], [5, 7, 11, 12, 13, 14, 15, 16]
    hook.STATE.last, hook.STATE.broken = hook.StepRecord(5, ["r"], [verified], [greedy]), None
    tok = np.zeros((1, 64), dtype=np.int64)
    tok[0, : len(ctx)] = ctx
    (draft,) = p.propose([[5, 7]], np.array([len(ctx)]), tok)  # (the prior cost: 0.1 a token)
    assert draft == [9, 9, 4, 3, 8, 2, 5]
    assert p.reqs["r"].source == 3  # what the next step learns from: a lookup after 3


def test_the_clock_times_each_vllm_step_between_the_proposers_calls(monkeypatch):
    """vLLM calls propose() once a step: from one call's return to the next call is the step that
    verified what the first call proposed (1 + its drafts a request)."""
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook, proposer

    p = _proposer(4, 1, 0.85)
    p.cost_aware = True
    now = iter([10.0, 10.01, 10.3, 10.31])
    monkeypatch.setattr(proposer.time, "perf_counter", lambda: next(now))
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]  # ends in 3 1 4, seen before: lookup drafts
    tok = np.zeros((2, 64), dtype=np.int64)
    tok[:, : len(ctx)] = ctx
    hook.STATE.last = None  # (no record: the lookup-only fallback drafts)
    drafts = p.propose([[4], [4]], np.array([len(ctx)] * 2), tok)
    assert [len(d) for d in drafts] == [3, 3]
    p.propose([[1], [5]], np.array([len(ctx)] * 2), tok)
    assert {w: list(t) for w, t in p.clock.times.items()} == {8: [pytest.approx(0.29)]}


def test_cost_aware_prices_a_draft_at_the_width_the_whole_step_verifies():
    """In a batch a draft costs what it adds to the step's width, after what the requests before
    it were proposed: with a step time flat up to 8 tokens and steep after, the first of two
    requests (the other at one token) gets its whole tail, the second only what still fits."""
    np = pytest.importorskip("numpy")
    from jacobi_vllm import hook

    p = _proposer(8, 1, 0.85)
    p.cost_aware = True
    for w in range(1, 17):  # flat up to 8 verified tokens, then half a step per token
        p.clock.step_starts(0.0, w)
        p.clock.step_ended(1.0 + 0.5 * max(0, w - 8))
    p.tail_policy.accepted[1], p.tail_policy.rejected[1] = 6.0, 4.0  # ~0.6 a draft
    ctx = [1, 2, 3, 4, 2, 5, 7]  # no lookup match
    verified, greedy = [5, 0, 0, 0, 0, 0, 0], [5, 7, 11, 12, 13, 14, 15, 16]
    rec = hook.StepRecord(5, ["a", "b"], [verified, verified], [greedy, greedy])
    hook.STATE.last, hook.STATE.broken = rec, None
    for rid in ("a", "b"):
        st = p._state(rid, ctx)
        st.source, st.main_len, st.block_ends = "jacobi", 8, [8]
    tok = np.zeros((2, 64), dtype=np.int64)
    tok[:, : len(ctx)] = ctx
    first, second = p.propose([[5, 7], [5, 7]], np.array([len(ctx)] * 2), tok)
    assert first == greedy[2:-1]  # 6 drafts: the step verifies 7 + 1 = 8 tokens, flat
    assert second == greedy[2:3]  # 1 more is worth half a step at 0.6 a draft; 2 are not


def test_bench_times_steps_by_the_width_they_verified():
    """bench/vllm_cpu.py's step time by width: the time between consecutive records of one call,
    grouped by the later step's width (its requests' drafts + 1 each), the median per width; the
    time between calls (and so the next call's prefill) left out."""
    from jacobi_vllm import hook

    spec = importlib.util.spec_from_file_location(
        "vllm_cpu_bench", Path(__file__).resolve().parents[1] / "bench" / "vllm_cpu.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def rec(at, *drafts):
        return hook.StepRecord(0, [f"r{i}" for i in range(len(drafts))], list(drafts), [], at)

    call1 = [rec(0.0, []), rec(0.030, [7, 8, 9]), rec(0.057, [7, 8, 9]), rec(0.090, [])]
    call2 = [rec(5.0, [], []), rec(5.040, [1], [2, 3]), rec(5.070, [1], [2, 3])]
    got = bench._step_times([call1, call2])
    assert got == {"1": [33.0, 1], "4": [28.5, 2], "5": [35.0, 2]}
