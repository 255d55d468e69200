"""Where one launch of the one-pass tree verifier spends its warp samples, from Nsight Compute's SASS page.

Reads the per-instruction CSV that ``ncu -i REPORT --page source --csv --print-source sass`` writes and
splits the kernel into its phases by how often each instruction ran: the prologue and the epilogue run
once per warp, the K-loop's body once per warp and K chunk, so the address-ordered instructions fall into
runs of equal execution counts. Within the epilogue, runs end at each tensor-core group's wait
(``WARPGROUP.DEPBAR``), which marks one `tl.dot` of the chain.

    ncu --clock-control none --kernel-name regex:gdn_tree_verify --launch-skip 1 --launch-count 1 \\
        --set full --import-source yes -o /tmp/v16 python3 benchmarks/verify_probe.py --ncu-case LABEL ...
    ncu -i /tmp/v16.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python benchmarks/ncu_phases.py sass.csv.gz --out phases.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path: str) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if SAMPLES in r)
    hdr = rows[start]
    return hdr, [r for r in rows[start + 1:] if len(r) >= len(hdr)]


def phases(hdr: list[str], data: list[list[str]]) -> dict:
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, c: int(r[ix[c]] or 0)
    runs = []  # consecutive instructions with the same execution count
    for r in data:
        if not runs or runs[-1]["executed"] != num(r, EXECUTED):
            runs.append(dict(executed=num(r, EXECUTED), rows=[]))
        runs[-1]["rows"].append(r)
    total = sum(num(r, SAMPLES) for r in data)
    out = []
    for run in runs:
        stalls = collections.Counter()
        for r in run["rows"]:
            for c in stall_cols:
                stalls[c] += num(r, c)
        n = sum(num(r, SAMPLES) for r in run["rows"])
        seg = dict(executed=run["executed"], instructions=len(run["rows"]), samples=n,
                   share=round(n / total, 4) if total else 0.0, first=run["rows"][0][1].strip(),
                   top_stalls=dict(stalls.most_common(4)))
        # inside a run: samples between consecutive tensor-core waits (one tl.dot each)
        marks, acc = [], 0
        for r in run["rows"]:
            acc += num(r, SAMPLES)
            if "WARPGROUP.DEPBAR" in r[1]:
                marks.append(acc)
        if len(marks) > 1:
            seg["samples_to_each_mma_wait"] = marks
        out.append(seg)
    return dict(total_samples=total, runs=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = dict(source=Path(args.csv).name, **phases(*load(args.csv)))
    for seg in res["runs"]:
        if seg["samples"]:
            print(f"executed {seg['executed']:6d}  {seg['instructions']:5d} instr  {seg['samples']:6d} samples "
                  f"({100 * seg['share']:4.1f}%)  {seg['top_stalls']}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
