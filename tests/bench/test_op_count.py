"""benchmarks/op_count.py: every phase of a speculative step is seen and counted."""

from benchmarks.op_count import count


def test_op_count_sees_every_phase():
    doc = count("bole", 1)
    phases = doc["per_phase"]
    for p in ("forest layout", "drafter", "target", "commit", "other"):
        assert phases.get(p, 0) > 0, (p, phases)
    assert doc["total"] == sum(phases.values())
