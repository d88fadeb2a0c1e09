"""torch.ops.jacobi_ext.verify_step against the pure-Python reference, on random steps."""

from __future__ import annotations

import math
import random

import pytest
import torch

from jacobi_ext.decoding import reference as ref


def _random_step(rng: random.Random, vocab: int, shared: dict | None = None):
    """One random step; `shared` fixes the sizes and knobs (n, K, p, eos, thr) of a batch."""
    n = shared["n"] if shared else rng.randint(2, 9)
    K = shared["K"] if shared else rng.randint(1, 4)
    nb = rng.randint(1, K)
    first = rng.randint(1, n)  # the real-active block may be partly committed already
    ends = [first] + [first + n * i for i in range(1, nb)]
    M = ends[-1]
    W = K * n

    def draft(length: int, base: list[int] | None = None) -> list[int]:
        # Mix exact matches with random tokens so acceptance lengths vary over the whole range.
        return [
            base[i] if base is not None and rng.random() < 0.7 else rng.randrange(vocab)
            for i in range(length)
        ]

    greedy0 = draft(M)
    main = [rng.randrange(vocab)] + [
        greedy0[i - 1] if rng.random() < 0.75 else rng.randrange(vocab) for i in range(1, M)
    ]
    rows, greedy = [main], [greedy0]
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.2:
            rows.append([])
            greedy.append([])
            continue
        g = draft(first)
        c = [main[0]] + [
            g[i - 1] if rng.random() < 0.7 else rng.randrange(vocab) for i in range(1, first)
        ]
        rows.append(c)
        greedy.append(g)
    p = shared["p"] if shared else rng.randint(0, 4)
    pool = []
    for _ in range(p):
        length = rng.randint(0, W)
        pool.append([rng.randrange(vocab) for _ in range(length)])
    head = rng.randrange(p) if p else 0
    init = [rng.randrange(vocab) for _ in range(n)]
    eos = shared["eos"] if shared else rng.choice([None, rng.randrange(vocab)])
    r = rng.choice([0.5, 0.85, 1.0])
    return dict(
        rows=rows,
        greedy=greedy,
        ends=ends,
        init=init,
        pool=pool,
        head=head,
        n=n,
        K=K,
        W=W,
        eos=eos,
        thr=shared["thr"] if shared else max(1, min(n, math.ceil(r * n))),
    )


def _to_op_args(s):
    R, W, K = len(s["rows"]), s["W"], s["K"]
    tok = torch.full((R, W), -1, dtype=torch.long)
    gre = torch.full((R, W), -1, dtype=torch.long)
    for i, (row, g) in enumerate(zip(s["rows"], s["greedy"], strict=True)):
        tok[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        gre[i, : len(g)] = torch.tensor(g, dtype=torch.long)
    row_len = torch.tensor([len(r) for r in s["rows"]], dtype=torch.int32)
    ends = torch.zeros(K, dtype=torch.int32)
    ends[: len(s["ends"])] = torch.tensor(s["ends"], dtype=torch.int32)
    p = len(s["pool"])
    pool = torch.full((p, W), -1, dtype=torch.long)
    pool_len = torch.zeros(p, dtype=torch.int32)
    for i, e in enumerate(s["pool"]):
        pool[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        pool_len[i] = len(e)
    head = torch.tensor([s["head"]], dtype=torch.int32)
    init = torch.tensor(s["init"], dtype=torch.long)
    eos = -1 if s["eos"] is None else s["eos"]
    return tok, gre, row_len, ends, init, pool, pool_len, head, s["thr"], eos


def _check_against_reference(s, out, pool, pool_len, head) -> None:
    want = ref.verify_step(
        s["rows"],
        s["greedy"],
        s["ends"],
        s["init"],
        s["pool"],
        s["head"],
        s["n"],
        s["K"],
        spawn_threshold=s["thr"],
        eos=s["eos"],
    )
    accept, summary, commit, next_tokens, next_ends, cands, cand_len = out
    assert accept.tolist() == want.accept
    w, a, fin, nl, nb, seed, ncand, _ = summary.tolist()
    assert (w, a, bool(fin)) == (want.winner, want.accepted, want.finished)
    assert commit[:a].tolist() == want.commit and (commit[a:] == -1).all()
    assert nl == len(want.next_tokens) and next_tokens[:nl].tolist() == want.next_tokens
    assert (next_tokens[nl:] == -1).all()
    assert nb == len(want.next_block_ends)
    assert next_ends[:nb].tolist() == want.next_block_ends and (next_ends[nb:] == 0).all()
    if nl:
        assert seed == want.next_tokens[0]
    got_cands = [cands[c, : cand_len[c]].tolist() for c in range(cands.shape[0])]
    assert got_cands == want.candidates
    assert ncand == sum(1 for c in want.candidates if c)
    got_pool = [pool[i, : pool_len[i]].tolist() for i in range(pool.shape[0])]
    assert got_pool == want.pool and int(head) == want.pool_head


@pytest.mark.parametrize("seed", range(400))
def test_verify_step_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    s = _random_step(rng, vocab=rng.choice([3, 5, 50]))
    args = _to_op_args(s)
    out = torch.ops.jacobi_ext.verify_step(*args)
    _check_against_reference(s, out, args[5], args[6], args[7])


def test_accept_rule_hand_worked() -> None:
    # tokens [5 6 7 8], greedy [6 7 9 10]: 6 and 7 match, 8 != 9 -> a = 3
    assert ref.accepted_length([5, 6, 7, 8], [6, 7, 9, 10], None) == 3
    # EOS (=7) inside the accepted prefix caps it there, inclusive
    assert ref.accepted_length([5, 6, 7, 8], [6, 7, 8, 1], 7) == 3
    assert ref.accepted_length([7, 6], [6, 0], 7) == 1  # the seed itself is EOS
    args = _to_op_args(
        dict(
            rows=[[5, 6, 7, 8]],
            greedy=[[6, 7, 9, 10]],
            ends=[4],
            init=[0, 1, 2, 3],
            pool=[[], []],
            head=0,
            n=4,
            K=2,
            W=8,
            eos=None,
            thr=3,
        )
    )
    accept, summary, commit, nxt, ends, _, _ = torch.ops.jacobi_ext.verify_step(*args)
    assert accept.tolist() == [3] and summary[1] == 3
    assert commit[:3].tolist() == [5, 6, 7]
    # next row: position 3 takes greedy[2] = 9; the block converged 3 >= 3 tokens, so a new
    # block spawns: its first token is greedy[3] = 10, then init_tokens[1:]
    assert nxt[: summary[3]].tolist() == [9, 10, 1, 2, 3]
    assert ends.tolist() == [1, 5]


def test_verify_step_rejects_bad_input() -> None:
    s = dict(
        rows=[[5, 6, 7, 8]],
        greedy=[[6, 7, 9, 10]],
        ends=[4],
        init=[0, 1, 2, 3],
        pool=[[1, 2]],
        head=0,
        n=4,
        K=1,
        W=4,
        eos=None,
        thr=3,
    )
    args = list(_to_op_args(s))
    bad = list(args)
    bad[0] = args[0].to(torch.int32)
    with pytest.raises(ValueError, match="tokens must have dtype"):
        torch.ops.jacobi_ext.verify_step(*bad)
    bad = list(args)
    bad[1] = args[1][:, :2]
    with pytest.raises(ValueError, match="greedy must have the shape of tokens"):
        torch.ops.jacobi_ext.verify_step(*bad)
    bad = list(args)
    bad[3] = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_ends must end at the main row"):
        torch.ops.jacobi_ext.verify_step(*bad)
    bad = list(args)
    bad[8] = 9
    with pytest.raises(ValueError, match="spawn_threshold"):
        torch.ops.jacobi_ext.verify_step(*bad)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(30))
def test_verify_step_cuda_matches_cpu(seed: int) -> None:
    rng = random.Random(1000 + seed)
    s = _random_step(rng, vocab=rng.choice([3, 50]))
    args = _to_op_args(s)
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.jacobi_ext.verify_step(*cuda_args)
    out = [o.cpu() for o in out]
    _check_against_reference(s, out, cuda_args[5].cpu(), cuda_args[6].cpu(), cuda_args[7].cpu())


# ---- the batch: one launch for B sequences ------------------------------------------------------


def _random_batch(rng: random.Random):
    """B sequences sharing n, K, p, eos and the spawn threshold, with different main-row lengths
    and candidate counts; some take no part (None: finished, or decoding as AR) and carry a
    random pool that must stay untouched. The vocabulary is small enough that EOS is hit often."""
    vocab = rng.choice([3, 5, 50])
    n = rng.randint(2, 9)
    shared = dict(n=n, K=rng.randint(1, 4), p=rng.randint(0, 4), thr=rng.randint(1, n))
    shared["eos"] = rng.choice([None, rng.randrange(vocab)])
    B = rng.randint(1, 6)
    steps = [None if rng.random() < 0.25 else _random_step(rng, vocab, shared) for _ in range(B)]
    return shared, steps


def _to_batch_args(rng: random.Random, shared: dict, steps: list):
    """The batched op's arguments: every sequence padded to the batch's rows (absent rows have
    length 0); a sequence that takes no part has an empty main row."""
    n, K, p = shared["n"], shared["K"], shared["p"]
    W = K * n
    B = len(steps)
    R = max([len(s["rows"]) for s in steps if s is not None] + [1])
    tok = torch.full((B, R, W), -1, dtype=torch.long)
    gre = torch.full((B, R, W), -1, dtype=torch.long)
    row_len = torch.zeros(B, R, dtype=torch.int32)
    ends = torch.zeros(B, K, dtype=torch.int32)
    init = torch.randint(0, 50, (B, n))
    pool = torch.randint(0, 50, (B, p, W))
    pool_len = torch.randint(0, W + 1, (B, p), dtype=torch.int32)
    head = torch.randint(0, max(p, 1), (B, 1), dtype=torch.int32)
    for b, s in enumerate(steps):
        if s is None:
            continue
        t, g, rl, e, i, pl, plen, h, _, _ = _to_op_args(s)
        tok[b, : t.shape[0]], gre[b, : g.shape[0]], row_len[b, : rl.shape[0]] = t, g, rl
        ends[b], init[b], pool[b], pool_len[b], head[b] = e, i, pl, plen, h
    eos = -1 if shared["eos"] is None else shared["eos"]
    return tok, gre, row_len, ends, init, pool, pool_len, head, shared["thr"], eos


def _check_batch(shared, steps, args, out, pool_before) -> None:
    """Sequence b of the batched op equals the single-sequence op on b alone and the reference;
    a sequence that takes no part has the neutral outputs and its pool untouched."""
    pool, pool_len, head = args[5], args[6], args[7]
    want = ref.verify_batch(
        [
            None
            if s is None
            else dict(rows=s["rows"], greedy=s["greedy"], block_ends=s["ends"],
                      init_tokens=s["init"], pool=s["pool"], pool_head=s["head"])
            for s in steps
        ],
        shared["n"], shared["K"], shared["thr"], shared["eos"],
    )  # fmt: skip
    for b, s in enumerate(steps):
        mine = [o[b] for o in out]
        if s is None:
            assert want[b] is None
            accept, summary, commit, nxt, ends, cands, cand_len = mine
            assert (accept == 0).all() and (summary == 0).all() and (commit == -1).all()
            assert (nxt == -1).all() and (ends == 0).all() and (cands == -1).all()
            assert (cand_len == 0).all()
            for t, t0 in zip((pool[b], pool_len[b], head[b]), pool_before, strict=True):
                assert torch.equal(t, t0[b])
            continue
        single = _to_op_args(s)
        one = torch.ops.jacobi_ext.verify_step(*single)
        R_b = single[0].shape[0]
        assert torch.equal(mine[0][:R_b], one[0]) and (mine[0][R_b:] == 0).all()
        for got, alone in zip(mine[1:], one[1:], strict=True):
            assert torch.equal(got, alone)
        assert torch.equal(pool[b], single[5]) and torch.equal(pool_len[b], single[6])
        assert torch.equal(head[b], single[7])
        cut = [mine[0][:R_b]] + mine[1:]
        _check_against_reference(s, cut, pool[b], pool_len[b], head[b])
        assert (want[b].winner, want[b].accepted) == tuple(mine[1][:2].tolist())


@pytest.mark.parametrize("seed", range(150))
def test_batched_verify_equals_single_sequence_calls(seed: int) -> None:
    rng = random.Random(5000 + seed)
    shared, steps = _random_batch(rng)
    torch.manual_seed(seed)
    args = _to_batch_args(rng, shared, steps)
    before = [args[5].clone(), args[6].clone(), args[7].clone()]
    out = torch.ops.jacobi_ext.verify_step(*args)
    B, R = args[0].shape[:2]
    n, K, p, W = shared["n"], shared["K"], shared["p"], shared["K"] * shared["n"]
    shapes = [(B, R), (B, 8), (B, W), (B, W + n), (B, K), (B, p, n), (B, p)]
    assert [tuple(o.shape) for o in out] == shapes  # fixed shapes, whatever the values
    _check_batch(shared, steps, args, out, before)


def test_batched_verify_hits_every_case() -> None:
    # The random batches above cover finished (EOS) sequences, sequences taking no part,
    # different main-row lengths and candidate counts in one batch: make sure they do.
    seen = set()
    for seed in range(150):
        rng = random.Random(5000 + seed)
        shared, steps = _random_batch(rng)
        torch.manual_seed(seed)
        args = _to_batch_args(rng, shared, steps)
        out = torch.ops.jacobi_ext.verify_step(*args)
        active = [b for b, s in enumerate(steps) if s is not None]
        seen.add("inactive" if len(active) < len(steps) else "all active")
        if any(out[1][b, 2] == 1 for b in active):
            seen.add("finished")
        if len({int(args[2][b, 0]) for b in active}) > 1:
            seen.add("different main lengths")
        if len({int((args[2][b] > 0).sum()) for b in active}) > 1:
            seen.add("different row counts")
    assert seen >= {"inactive", "finished", "different main lengths", "different row counts"}


def test_batched_verify_rejects_bad_input() -> None:
    rng = random.Random(1)
    shared = dict(n=4, K=2, p=2, thr=2, eos=None)
    steps = [_random_step(rng, 50, shared), None]
    args = list(_to_batch_args(rng, shared, steps))
    bad = list(args)
    bad[3] = args[3][:1]
    with pytest.raises(ValueError, match="block_ends must have one entry per sequence"):
        torch.ops.jacobi_ext.verify_step(*bad)
    bad = list(args)
    bad[2] = args[2].clone()
    bad[2][1, 1] = 3  # a candidate row in a sequence that takes no part
    with pytest.raises(ValueError, match="takes no part"):
        torch.ops.jacobi_ext.verify_step(*bad)
    bad = list(args)
    bad[7] = args[7].view(-1)
    with pytest.raises(ValueError, match="pool_head must be 2-D"):
        torch.ops.jacobi_ext.verify_step(*bad)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(30))
def test_batched_verify_cuda_matches_cpu(seed: int) -> None:
    rng = random.Random(7000 + seed)
    shared, steps = _random_batch(rng)
    torch.manual_seed(seed)
    args = _to_batch_args(rng, shared, steps)
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    out = [o.cpu() for o in torch.ops.jacobi_ext.verify_step(*cuda_args)]
    want = torch.ops.jacobi_ext.verify_step(*args)
    for got, cpu in zip(out, want, strict=True):
        assert torch.equal(got, cpu)
    for i in (5, 6, 7):  # the pools, updated in place on each device
        assert torch.equal(cuda_args[i].cpu(), args[i])


@pytest.mark.parametrize("seed", range(6))
def test_verify_step_opcheck(seed: int) -> None:
    # Schema (in-place pool), fake (shapes for torch.compile) and dispatch agree with the kernel,
    # for one sequence and for a batch.
    rng = random.Random(9000 + seed)
    torch.manual_seed(seed)
    if seed % 2:
        args = _to_op_args(_random_step(rng, vocab=rng.choice([3, 50])))
    else:
        shared, steps = _random_batch(rng)
        args = _to_batch_args(rng, shared, steps)
    torch.library.opcheck(torch.ops.jacobi_ext.verify_step.default, args)
