"""benchmarks/ncu_phases.py: Nsight Compute's SASS page split into prologue, K-loop and epilogue by
execution counts, and the epilogue's samples cut at each tensor-core wait."""

import csv
import gzip

from benchmarks.ncu_phases import load, phases

HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
       "stall_wait", "stall_long_sb (Not Issued)"]


def test_phases_from_a_sass_csv(tmp_path):
    rows = [  # prologue (once per warp), loop body (4 chunks), epilogue with two MMA waits, exit
        ("0x0", "LDC R1", 3, 8, 3, 0), ("0x10", "LDG R2", 5, 8, 5, 0),
        ("0x20", "HGMMA", 10, 32, 4, 6), ("0x30", "BRA", 2, 32, 0, 2),
        ("0x40", "FMUL", 4, 8, 0, 4), ("0x50", "WARPGROUP.DEPBAR.LE gsb0", 6, 8, 0, 6),
        ("0x60", "HGMMA", 1, 8, 0, 1), ("0x70", "WARPGROUP.DEPBAR.LE gsb0", 9, 8, 0, 9),
        ("0x80", "EXIT", 0, 0, 0, 0)]
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "gdn_tree_verify_kernel"])
        w.writerow(HDR)
        for a, src, n, ex, lsb, wt in rows:
            w.writerow([a, "  " + src, n, ex, lsb, wt, 0])
    res = phases(*load(str(path)))
    runs = res["runs"]
    assert res["total_samples"] == 40
    assert [(r["executed"], r["instructions"], r["samples"]) for r in runs] == [(8, 2, 8), (32, 2, 12), (8, 4, 20),
                                                                             (0, 1, 0)]
    assert runs[1]["top_stalls"] == {"stall_wait": 8, "stall_long_sb": 4}
    assert runs[2]["samples_to_each_mma_wait"] == [10, 20]
    assert abs(sum(r["share"] for r in runs) - 1) < 1e-3
