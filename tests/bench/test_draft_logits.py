"""benchmarks/draft_logits.py's harness on the CPU (tiny shapes, float32): every row is written with its
three times, the strided call and the flattened GEMM agree with float64, and the flattened GEMM is the
drafter's own compute_logits."""

import json
import sys
from pathlib import Path

import torch
from engine_helpers import meta_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import draft_logits  # noqa: E402

from bole.models.qwen3_5 import HybridForCausalLM  # noqa: E402


def test_smoke_writes_rows(tmp_path):
    out = tmp_path / "d.json"
    draft_logits.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["gpu"] == "cpu" and res["command"].startswith("draft_logits.py --smoke")
    assert [(r["B"], r["M"], r["N"], r["K"]) for r in res["rows"]] == [(1, 4, 256, 64), (4, 4, 256, 64)]
    for r in res["rows"]:
        assert r["strided_ms"] > 0 and r["gemm_ms"] > 0 and r["wxt_ms"] > 0
        assert max(r["strided_max_err"], r["gemm_max_err"], r["wxt_max_err"]) < 1e-4


def test_flat_gemm_is_the_drafters_compute_logits():
    torch.manual_seed(0)
    mtp = HybridForCausalLM(meta_model().config, backend="torch", num_mtp_layers=1).mtp
    h = torch.randn(2, 9, mtp._shared[1].weight.shape[1])[:, 5:]
    with torch.inference_mode():
        assert torch.equal(draft_logits.flat_gemm(h, mtp._shared[1].weight), mtp.compute_logits(h))
