"""torch.ops.jacobi_ext.verify_step against the pure-Python reference, on random steps."""

from __future__ import annotations

import math
import random

import pytest
import torch

from jacobi_ext.decoding import reference as ref


def _random_step(rng: random.Random, vocab: int):
    n = rng.randint(2, 9)
    K = rng.randint(1, 4)
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
    p = rng.randint(0, 4)
    pool = []
    for _ in range(p):
        length = rng.randint(0, W)
        pool.append([rng.randrange(vocab) for _ in range(length)])
    head = rng.randrange(p) if p else 0
    init = [rng.randrange(vocab) for _ in range(n)]
    eos = rng.choice([None, rng.randrange(vocab)])
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
        thr=max(1, min(n, math.ceil(r * n))),
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
