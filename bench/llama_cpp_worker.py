"""llama.cpp's greedy decoding of given token ids, in a process of its own (bench_llama_cpp.py
starts it): ggml brings its own OpenMP runtime and thread pool, which in one process beside
torch's would slow both. No torch here.

Protocol: argv = model path, threads, n_ctx[, "off"]: "off" loads the weights without
llama.cpp's extra buffer types (its AMX and repacked CPU layouts; bench_llama_cpp.py says
where and why). Then one JSON request a line on stdin,
{"ids": [...], "max_new": N, "eos": [...]}, answered by one JSON line on stdout: the tokens
and the timings of the whole call, its prefill (the prompt's eval) and its steady decode.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import llama_cpp
    import numpy as np

    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    extra_bufts = sys.argv[4:5] != ["off"]
    if not extra_bufts:  # Llama() loads with these defaults: use_extra_bufts off in them
        import llama_cpp.llama_cpp as api

        defaults = api.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
        verbose=False, logits_all=False,
    )  # fmt: skip
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last evaluated token's logits
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    hello = {"version": getattr(llama_cpp, "__version__", "?"), "extra_bufts": extra_bufts}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ids, max_new, eos = req["ids"], req["max_new"], set(req["eos"])
        t0 = time.perf_counter()
        llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache first
        llm.eval(ids)
        tok = argmax()
        tokens = [tok]
        t1 = time.perf_counter()
        forwards = 0
        while len(tokens) < max_new and tok not in eos:
            llm.eval([tok])
            forwards += 1
            tok = argmax()
            tokens.append(tok)
        t2 = time.perf_counter()
        out = dict(tokens=tokens, seconds=t2 - t0, prefill_seconds=t1 - t0,
                   decode_seconds=t2 - t1, forwards=forwards)  # fmt: skip
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
