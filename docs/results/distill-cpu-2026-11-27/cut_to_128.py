"""Chunk I2's data: chunk J's collection (256-token cap) cut to the answers that reached EOS
within 128 new tokens, which is what a 128-token collection keeps under `train --finished-only`
(rows are computed independently in a batched forward, so the first 128 tokens of a record do not
depend on the cap).

    python docs/results/distill-cpu-2026-11-27/cut_to_128.py runs/chunkJ/data runs/chunkI2/data
"""

import json
import sys
from pathlib import Path


def main(src: Path, dst: Path, cap: int = 128) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    kept = total = 0
    for f in sorted(src.glob("trajectories-*.jsonl")):
        with f.open() as fin, (dst / f.name).open("w") as fout:
            for line in fin:
                total += 1
                r = json.loads(line)
                if r["finished"] and r["new_tokens"] <= cap:
                    fout.write(line)
                    kept += 1
    meta = json.loads((src / "meta.json").read_text())
    meta["max_new_tokens"] = cap
    meta["note"] = f"the records of {src} that reached EOS within {cap} new tokens"
    (dst / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{dst}: {kept} of {total} records")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
