"""benchmarks/kernel_sweep.precompile: a worker that never finishes must not stall the benchmark."""

import time

from benchmarks.kernel_sweep import BoleKernel, precompile


def fake_compile(kind, model, batch, T, kw):
    """Stands in for a Triton compile: block_v=0 fails, block_v=-1 never finishes, others succeed."""
    if kw["block_v"] == -1:
        time.sleep(3600)
    return "ValueError: bad config" if kw["block_v"] == 0 else None


def test_precompile_stops_at_its_budget_and_skips_what_did_not_finish():
    bole = BoleKernel(fn=lambda **kw: None)
    tasks = [("bole", "m", 1, 64, dict(block_v=bv)) for bv in (16, 0, -1, 32)]
    notes = []
    t0 = time.time()
    spent = precompile(tasks, 2, bole, notes, timeout_s=8.0, fn=fake_compile)
    assert spent < 30 and time.time() - t0 < 30  # the hung worker was terminated, not waited for
    assert bole.failed == {("m", 64, "block_v=0"), ("m", 64, "block_v=-1")}
    assert any("not compiled within the precompile budget" in n for n in notes)
    assert any("1 tasks unfinished" in n for n in notes)
