"""Calibration tables and batch-shared node selection (bole/spec/budget.py)."""

import copy
from pathlib import Path

import pytest
import torch

from bole.spec.budget import (
    GOODPUT_SLOTS,
    CalibrationTable,
    goodput_costs,
    goodput_rows,
    resolve_budget_rule,
    select_b_ver,
    select_nodes,
    width_cap,
)
from bole.spec.tree import random_tree

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- eq. 12 and tables

def test_select_b_ver_eq12():
    t_ver = {8: 10.0, 16: 10.5, 32: 11.0, 64: 13.0}
    assert select_b_ver(t_ver, 10.0, 0.1) == 32      # 11.0 <= 11.0 (bound inclusive)
    assert select_b_ver(t_ver, 10.0, 0.3) == 64
    assert select_b_ver(t_ver, 10.0, 0.0) == 8
    assert select_b_ver(t_ver, 9.0, 0.1) == 32       # T_dec below verify's floor: bounded over the floor
    assert select_b_ver(t_ver, 5.0, 0.1) == 32       # 10.0 is the floor whatever decode costs
    assert select_b_ver(t_ver, 5.0, 0.04) == 8       # 10.5 > 10.4: only the floor itself
    assert select_b_ver(t_ver, 12.0, 0.0) == 32      # decode above the floor: eq. 12 as written
    with pytest.raises(ValueError):
        select_b_ver({}, 1.0, 0.1)


def test_default_table_loads_and_scales_down_per_request():
    t = CalibrationTable.load(REPO / "calibration_tables" / "default.yaml")
    assert t.source == "default" and t.lookup(1, 0, 1) == (0, 64)
    shares = [t.lookup(b, 1000, 6)[1] / b for b in (1, 2, 4, 8, 16, 32, 64)]
    assert shares == sorted(shares, reverse=True) and shares[0] == 64
    assert t.lookup(10**6, 10**9, 99)[0] == len(t.buckets) - 1  # beyond the table: clamp


def measured_table() -> dict:
    """2 batch x 2 kv buckets, one depth bucket, with timings consistent with eq. 12 (ε = 0.1)."""
    def bucket(batch, kv, t_dec, t_ver):
        return {"batch": batch, "kv": kv, "depth": [1, 16], "b_ver": select_b_ver(t_ver, t_dec, 0.1),
                "t_dec_ms": t_dec, "t_ver_ms": t_ver}
    return {
        "hardware": "h200", "model": "qwen3.5-9b", "dtype": "bfloat16", "tp_size": 1,
        "versions": {"torch": "2.13.0"}, "date": "2026-01-31", "epsilon": 0.1, "source": "measured",
        "capture_set": [16, 32, 64],
        "buckets": [
            bucket([1, 4], [0, 4095], 10.0, {16: 10.2, 32: 10.9, 64: 12.0}),
            bucket([1, 4], [4096, 65535], 12.0, {16: 12.1, 32: 12.5, 64: 13.1}),
            bucket([5, 64], [0, 4095], 14.0, {16: 15.0, 32: 16.8, 64: 19.0}),
            bucket([5, 64], [4096, 65535], 16.0, {16: 16.5, 32: 17.5, 64: 20.0}),
        ],
    }


def test_with_epsilon_rederives_b_ver_from_the_timings(tmp_path):
    """SpecConfig.budget_epsilon: the same timings at another ε (eq. 12 per bucket); the result is a valid
    table (its b_ver agree with eq. 12 at the new ε when it is written and read back)."""
    t = CalibrationTable.from_dict(measured_table())
    assert t.with_epsilon(0.1) == t
    wide = t.with_epsilon(0.2)  # bounds 1.2 x max(T_dec, T_ver(16)): 12.24, 14.52, 18.0, 19.8 ms
    assert wide.epsilon == 0.2 and [b.b_ver for b in wide.buckets] == [64, 64, 32, 32]
    assert [b.b_ver for b in t.with_epsilon(0.0).buckets] == [16, 16, 16, 16]
    assert [b.t_ver_ms for b in wide.buckets] == [b.t_ver_ms for b in t.buckets]
    wide.dump(tmp_path / "t.yaml")
    assert CalibrationTable.load(tmp_path / "t.yaml") == wide
    h200 = CalibrationTable.load(REPO / "calibration_tables" / "h200-qwen3.5-9b.yaml")
    assert h200.with_epsilon(h200.epsilon) == h200  # the committed table is eq. 12 of its own timings
    for bad in (-0.1, float("inf"), float("nan"), True, "0.2", None):
        with pytest.raises(ValueError, match="budget epsilon"):
            t.with_epsilon(bad)
    with pytest.raises(ValueError, match="without timings"):  # a default table's b_ver is written, not derived
        CalibrationTable.load(REPO / "calibration_tables" / "default.yaml").with_epsilon(0.2)


def test_lookup_and_roundtrip(tmp_path):
    t = CalibrationTable.from_dict(measured_table())
    assert [b.b_ver for b in t.buckets] == [32, 64, 16, 32]
    assert t.lookup(1, 0, 1) == (0, 32)
    assert t.lookup(4, 4096, 3) == (1, 64)
    assert t.lookup(5, 4095, 3) == (2, 16)
    assert t.lookup(500, 10**7, 30) == (3, 32)
    assert t.table_id == "h200/qwen3.5-9b/bfloat16/tp1@2026-01-31"
    t.dump(tmp_path / "t.yaml")
    assert CalibrationTable.load(tmp_path / "t.yaml") == t
    with pytest.raises(ValueError, match="bad bucket query"):
        t.lookup(0, 0, 1)


def _broken(edit):
    d = copy.deepcopy(measured_table())
    edit(d)
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("epsilon"), "missing keys: \\['epsilon'\\]"),
    (lambda d: d.update(colour="red"), "unknown keys: \\['colour'\\]"),
    (lambda d: d.update(source="guessed"), "source must be one of"),
    (lambda d: d.update(capture_set=[32, 16]), "capture_set"),
    (lambda d: d["buckets"][0].pop("b_ver"), "bucket 0: missing keys \\['b_ver'\\]"),
    (lambda d: d["buckets"][1].update(kv=[4000, 65535]), "overlapping buckets 0 and 1"),
    (lambda d: d["buckets"][1].update(kv=[5000, 65535]), "gap in buckets: no bucket covers batch=1, kv=4096"),
    (lambda d: [b.update(batch=[2, 4]) for b in d["buckets"][:2]], "must start at batch=1"),
    (lambda d: d["buckets"][2].update(depth=[3, 1]), "bucket 2: depth must be"),
    (lambda d: d["buckets"][0].update(b_ver=48), "b_ver=48 must be an int >= 1 in capture_set"),
    (lambda d: d["buckets"][0].update(b_ver=0), "b_ver=0"),
    (lambda d: d["buckets"][3]["t_ver_ms"].update({32: 16.0}), "bucket 3: non-monotone timings"),
    (lambda d: d["buckets"][0]["t_ver_ms"].update({48: 11.0}), "capacities \\[48\\] are not in capture_set"),
    (lambda d: d["buckets"][0].update(b_ver=16), "b_ver=16 disagrees with eq. 12"),
    (lambda d: d["buckets"][0].update(t_dec_ms=None), "required in a 'measured' table"),
    (lambda d: d["buckets"][0].update(t_dec_ms=-1.0), "t_dec_ms must be a positive number"),
])
def test_table_validation(edit, message):
    with pytest.raises(ValueError, match=message):
        CalibrationTable.from_dict(_broken(edit))


def test_load_names_the_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("hardware: x\n")
    with pytest.raises(ValueError, match="bad.yaml: missing keys"):
        CalibrationTable.load(tmp_path / "bad.yaml")


# ---------------------------------------------------------------- node selection

def random_batch(B, T, g, ratios=(1.0, 0.5, 0.25)):
    """Padded random trees; ρ = product of ratios drawn from a small set, so ties are common
    (ratio 1 even ties a child with its parent)."""
    parents = torch.full((B, T), -1, dtype=torch.long)
    depth = torch.zeros(B, T, dtype=torch.long)
    rho = torch.zeros(B, T)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(1, T + 1, (1,), generator=g))
        tree = random_tree(n, 6, generator=g)
        for i, p in enumerate(tree.parents):
            r = ratios[int(torch.randint(len(ratios), (1,), generator=g))]
            parents[b, i], depth[b, i], valid[b, i] = p, tree.depths[i], True
            rho[b, i] = r * (1.0 if p < 0 else float(rho[b, p]))
    return rho, parents, valid, depth


def reference_select(rho, valid, depth, b_ver):
    B, T = rho.shape
    keep = valid & (depth == 1)
    remaining = max(b_ver - int(keep.sum()), 0)
    cands = [(-float(rho[b, i]), int(depth[b, i]), b * T + i) for b in range(B) for i in range(T)
             if valid[b, i] and depth[b, i] != 1]
    for _, _, flat in sorted(cands)[:remaining]:
        keep[flat // T, flat % T] = True
    return keep


def assert_prefix_closed(keep, parents):
    B, T = keep.shape
    for b in range(B):
        for i in range(T):
            if keep[b, i] and parents[b, i] >= 0:
                assert keep[b, parents[b, i]], f"request {b}: node {i} kept without its parent"


@pytest.mark.parametrize("seed", range(6))
def test_select_nodes_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 24
    rho, parents, valid, depth = random_batch(B, T, g)
    total, floor = int(valid.sum()), int((valid & (depth == 1)).sum())
    for b_ver in (0, 1, floor, floor + 3, total // 2, total, total + 10):
        keep = select_nodes(rho, parents, valid, depth, b_ver, floor="children")
        assert torch.equal(keep, reference_select(rho, valid, depth, b_ver)), f"b_ver={b_ver}"
        assert_prefix_closed(keep, parents)
        assert int(keep.sum()) == max(floor, min(b_ver, total))
        assert not (keep & ~valid).any()
        # log-probabilities select the same nodes (only the order matters)
        assert torch.equal(keep, select_nodes(rho.log(), parents, valid, depth, torch.tensor(b_ver), floor="children"))


def test_fairness_floor_keeps_every_request_first_level():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 16
    rho, parents, valid, depth = random_batch(B, T, g)
    rho[0] = torch.where(valid[0], torch.ones(T), rho[0])  # request 0 is far more confident
    rho[1:] *= 1e-3
    floor = valid & (depth == 1)
    keep = select_nodes(rho, parents, valid, depth, int(floor.sum()) + 2, floor="children")
    assert (keep[floor]).all()
    extra = keep & ~floor
    assert int(extra.sum()) == min(2, int((valid & ~floor).sum()))
    assert not extra[1:].any()  # the spare budget goes to the confident request


def test_select_nodes_prefix_closed_even_if_rho_increases():
    g = torch.Generator().manual_seed(9)
    B, T = 4, 20
    _, parents, valid, depth = random_batch(B, T, g)
    rho = torch.rand(B, T, generator=g)  # not monotone along paths
    for b_ver in range(0, int(valid.sum()) + 1, 3):
        keep = select_nodes(rho, parents, valid, depth, b_ver, floor="children")
        assert_prefix_closed(keep, parents)
        assert int(keep.sum()) == max(int((valid & (depth == 1)).sum()), min(b_ver, int(valid.sum())))


def test_select_nodes_no_host_sync_on_meta():
    m = dict(device="meta")
    keep = select_nodes(torch.zeros(3, 8, **m), torch.zeros(3, 8, dtype=torch.long, **m),
                        torch.ones(3, 8, dtype=torch.bool, **m), torch.ones(3, 8, dtype=torch.long, **m),
                        torch.tensor(5, **m), floor="children")
    assert keep.is_meta and keep.shape == (3, 8)


@pytest.mark.parametrize("seed", range(4))
def test_select_nodes_per_request_cap(seed):
    """The verifier's tree limit: at most ``cap`` kept nodes per request, the budget a capped request
    cannot use going to the others in the global order (reference: a greedy walk of that order)."""
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 4, 24
    rho, parents, valid, depth = random_batch(B, T, g)
    floor = valid & (depth == 1)
    for cap in (int(floor.sum(1).max()), int(floor.sum(1).max()) + 2, 10, T):
        for b_ver in (0, 5, 20, int(valid.sum())):
            keep = select_nodes(rho, parents, valid, depth, b_ver, max_per_request=cap, floor="children")
            ref = floor.clone()
            remaining = max(b_ver - int(floor.sum()), 0)
            cands = sorted((-float(rho[b, i]), int(depth[b, i]), b * T + i) for b in range(B) for i in range(T)
                           if valid[b, i] and depth[b, i] != 1)
            for _, _, flat in cands:
                b = flat // T
                if remaining and int(ref[b].sum()) < cap:
                    ref[b, flat % T] = True
                    remaining -= 1
            assert torch.equal(keep, ref), f"cap={cap} b_ver={b_ver}"
            assert int(keep.sum(1).max()) <= cap
            assert_prefix_closed(keep, parents)


def test_feasible_capacities_keep_trees_within_the_kernel_tile():
    from bole.spec.tree import MAX_TREE_NODES, feasible_capacities

    assert feasible_capacities([8, 64, 255, 256, 512], 1) == [8, 64, 255]
    assert feasible_capacities([8, 64, 255, 256, 510, 512], 2) == [8, 64, 255, 256, 510]
    assert all(1 + -(-n // 3) <= MAX_TREE_NODES for n in feasible_capacities(range(1, 1000), 3))


def test_width_cap_is_the_calibrations_tree_width():
    widths = [8, 16, 32, 64, 117]   # an engine's: the defaults below its lookahead, and the lookahead
    # batch 16, B_ver 96: 6 drafts + the root a request when split evenly -> width 8 -> 7 drafts
    assert width_cap(96, 16, widths, 127) == 7
    assert width_cap(48, 8, widths, 127) == 7 and width_cap(48, 4, widths, 127) == 15   # 12 + 1 -> 16
    assert width_cap(48, 1, widths, 127) == 63 and width_cap(64, 1, widths, 127) == 116  # 65 -> the lookahead
    assert width_cap(500, 1, widths, 127) == 127 and width_cap(96, 16, widths, 5) == 5   # past the widest; capped
    assert width_cap(0, 3, widths, 127) == 7
    with pytest.raises(ValueError, match="batch >= 1"):
        width_cap(8, 0, widths, 127)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_spec_config_refuses_a_bad_cap_or_floor(bad):
    from bole.config import SpecConfig

    with pytest.raises(ValueError, match="cap_tree_width"):
        SpecConfig(cap_tree_width=bad)
    assert SpecConfig(cap_tree_width=True).cap_tree_width is True
    with pytest.raises(ValueError, match="budget_floor"):
        SpecConfig(budget_floor=bad)
    assert SpecConfig(budget_floor="best_child").budget_floor == "best_child"


def test_capped_selection_fits_the_calibrated_width():
    # B_ver nodes over uneven trees: with the cap every tree fits the width the even split needs
    B, T = 4, 40
    gen = torch.Generator().manual_seed(0)
    parents = torch.stack([torch.tensor(random_tree(T, 6, generator=gen).parents) for _ in range(B)])
    depth = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for i in range(T):
            depth[b, i] = 1 if parents[b, i] < 0 else depth[b, parents[b, i]] + 1
    rho = -torch.rand(B, T, generator=gen).cumsum(1) * torch.tensor([0.1, 1.0, 1.0, 1.0])[:, None]  # request 0 wins
    valid = torch.ones(B, T, dtype=torch.bool)
    b_ver = 24
    free = select_nodes(rho, parents, valid, depth, b_ver, floor="children")
    cap = width_cap(b_ver, B, [8, 16, 32], T)
    capped = select_nodes(rho, parents, valid, depth, b_ver, max_per_request=cap, floor="children")
    floor = int((depth == 1).sum(1).max())
    assert int(free.sum(1).max()) > cap  # uncapped, the likeliest request takes more than its width
    assert int(capped.sum(1).max()) <= max(cap, floor) and cap == 7


def _forest(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor(random_tree(T, 6, generator=gen).parents) for _ in range(B)])
    depth = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for i in range(T):
            depth[b, i] = 1 if parents[b, i] < 0 else depth[b, parents[b, i]] + 1
    rho = torch.zeros(B, T)
    logp = -torch.rand(B, T, generator=gen) * 3
    for b in range(B):
        for i in range(T):  # cumulative log-probability down each path
            rho[b, i] = logp[b, i] + (rho[b, parents[b, i]] if parents[b, i] >= 0 else 0.0)
    return rho, parents, torch.ones(B, T, dtype=torch.bool), depth


@pytest.mark.parametrize("b_ver", [0, 5, 12, 30, 1000])
def test_best_child_floor_keeps_one_first_level_draft_each(b_ver):
    B, T = 4, 24
    rho, parents, valid, depth = _forest(B, T, 1)
    keep = select_nodes(rho, parents, valid, depth, b_ver, floor="best_child")
    children = select_nodes(rho, parents, valid, depth, b_ver, floor="children")
    first = depth == 1
    best = torch.where(first, rho, torch.full_like(rho, -float("inf"))).argmax(1)
    assert keep[torch.arange(B), best].all()                           # every request keeps its best child
    assert int(keep.sum()) == max(B, min(b_ver, B * T))                # the floor is one node a request
    assert int(children.sum()) == max(int(first.sum()), min(b_ver, B * T))
    kept_parents = parents.clamp(min=0).gather(1, torch.arange(T).expand(B, T))
    assert (~keep | (parents < 0) | keep.gather(1, kept_parents)).all()   # prefix-closed
    if B < b_ver < int(first.sum()):   # the budget past one child each goes by ρ, not to every child
        assert int((keep & first).sum()) < int(first.sum())
    with pytest.raises(ValueError, match="floor must be one of"):
        select_nodes(rho, parents, valid, depth, b_ver, floor="none")
    with pytest.raises(TypeError, match="floor"):   # no default: the engine's choice is SpecConfig.budget_floor
        select_nodes(rho, parents, valid, depth, b_ver)


def test_verify_rows_limit():
    from bole.spec.budget import rows_width, verify_rows_limit

    # depth 8 / topk 4 / beam 4: 117-node trees, widths 8 .. 64 and 117; the floor (best_child: 1 draft) pads to 8
    assert verify_rows_limit(32, 117, 1) == 32 * 117                      # None: every request's whole tree
    assert verify_rows_limit(32, 117, 1, requested=1024) == 1024
    assert verify_rows_limit(4, 117, 1, requested=1024) == 4 * 117        # never more than the whole trees
    assert verify_rows_limit(32, 117, 4, requested=300) == 300            # children floor: 4 + 1 -> 8 a tree
    with pytest.raises(ValueError, match=r"max_verify_rows=255 is below the 256 rows that max_num_seqs=32"):
        verify_rows_limit(32, 117, 1, requested=255)
    assert verify_rows_limit(32, 117, 1, requested=255, check=False) == 256
    widths = [8, 16, 32, 64, 117]
    assert rows_width(1024, 32, widths) == 32 and rows_width(1024, 8, widths) == 117
    assert rows_width(256, 32, widths) == 8
    with pytest.raises(ValueError, match="no tree width"):
        rows_width(255, 32, widths)


# ---------------------------------------------------------------- the goodput rule (budget_rule="goodput")

def _goodput_reference(rho, parents, valid, depth, b_ver, costs, floor, cap=None):
    """The goodput rule by brute force: eq. 12's selection at every usable capacity N under its own
    per-request cap, scored in float64 as (requests + Σ exp ρ of what it keeps) / T_ver(N); the best
    (ties: the smallest N): its selection and N."""
    nf = int(select_nodes(rho, parents, valid, depth, 0, floor=floor).sum())
    real = [c for c in costs if c[0] <= b_ver]
    usable = [c for c in real if c[0] >= nf] or real[:1]
    best = None
    for n, t, w in usable:
        keep = select_nodes(rho, parents, valid, depth, n, max_per_request=w if cap is None else min(w, cap),
                            floor=floor)
        score = (float(valid.any(1).sum()) + rho.double()[keep].exp().sum().item()) / t
        if best is None or score > best[0] * (1 + 1e-9):
            best = (score, keep, n)
    return best[1], best[2]


def _costs(rows):
    """[3, K] costs from (N, T_ver) pairs (no per-capacity cap) or (N, T_ver, drafts per request) triples,
    padded with capacity 0, as the graphs do."""
    rows = [r if len(r) == 3 else (*r, 10**4) for r in rows]
    return torch.tensor(rows + [(0, 0.0, 0)] * 3, dtype=torch.float32).T


def _triples(pairs, widths=None):
    return [(n, t, 10**4 if widths is None else widths[i]) for i, (n, t) in enumerate(pairs)]


# T_ver curves: a dense plateau, a MoE climb that flattens (the 35B-A3B table's batch-8 bucket), a linear one
CURVES = {"plateau": [(8, 10.0), (16, 10.2), (32, 10.5), (64, 11.0), (128, 14.0), (256, 25.0)],
          "moe": [(8, 16.6), (16, 18.4), (32, 20.9), (64, 24.2), (128, 27.9), (256, 32.5)],
          "linear": [(8, 8.0), (16, 16.0), (32, 32.0), (64, 64.0)]}


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("floor", ["children", "best_child"])
@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 8.0])   # ρ: certain drafts (log 1), confident, doubtful, hopeless
def test_goodput_selection_is_the_best_capacity_by_brute_force(curve, floor, scale):
    for seed, (B, T, cap) in enumerate([(1, 40, None), (4, 24, None), (8, 30, 15), (3, 64, 63)]):
        rho, parents, valid, depth = _forest(B, T, seed)
        rho = rho * scale / 3   # _forest draws per-edge log-probabilities in [-3, 0]
        valid[-1, T // 2:] = False if B > 1 else valid[-1, T // 2:]   # a short request
        pairs = CURVES[curve]
        # no per-capacity cap; the calibration's widths (width_cap); a tight one, below the floor at first
        for widths in (None, [width_cap(n, B, [8, 16, 32, 64], 63) for n, _ in pairs],
                       [1 + i for i in range(len(pairs))]):
            triples = _triples(pairs, widths)
            for b_ver in (256, 64, 8):
                chosen = torch.full((), -1)
                got = select_nodes(rho, parents, valid, depth, b_ver, max_per_request=cap, floor=floor,
                                   costs=_costs(triples), chosen=chosen)
                want, n = _goodput_reference(rho, parents, valid, depth, b_ver, triples, floor, cap)
                assert torch.equal(got, want), (curve, floor, scale, seed, widths, b_ver)
                assert int(chosen) == n, (curve, floor, scale, seed, widths, b_ver)   # what the metrics report


def test_goodput_width_caps_keep_every_tree_within_the_timed_width():
    """Certain drafts in one deep request, hopeless ones elsewhere: uncapped, the rule scores a small
    capacity while that request's tree pads every request to its width (rows the capacity was never timed
    at); with the calibration's widths every tree fits the width of the capacity it was scored at."""
    B, T = 8, 30
    rho, parents, valid, depth = _forest(B, T, 5)
    rho = torch.where(torch.arange(B)[:, None] == 0, torch.zeros_like(rho), rho * 30)   # request 0 certain
    pairs = CURVES["moe"]
    timed = lambda n: width_cap(n, B, [8, 16, 32, 64], 63)   # drafts a request at capacity n, as timed
    scored = lambda keep: next(n for n, _ in pairs if n >= int(keep.sum()))   # the capacity it was scored at
    free = select_nodes(rho, parents, valid, depth, 256, floor="best_child", costs=_costs(pairs))
    assert int(free.sum(1).max()) > timed(scored(free))      # 25 drafts in one tree, scored at 32 (7 a tree)
    triples = _triples(pairs, [timed(n) for n, _ in pairs])
    capped = select_nodes(rho, parents, valid, depth, 256, floor="best_child", costs=_costs(triples))
    assert int(capped.sum(1).max()) <= timed(scored(capped))
    assert int(capped[0].sum()) == T   # the whole certain tree still, at the capacity whose width holds it
    assert torch.equal(capped, _goodput_reference(rho, parents, valid, depth, 256, triples, "best_child")[0])


def test_goodput_keeps_more_where_the_climb_flattens_and_fewest_for_hopeless_drafts():
    B, T = 8, 30
    rho, parents, valid, depth = _forest(B, T, 5)
    certain = torch.zeros_like(rho)   # every draft accepted for sure: the flat end of the MoE curve pays
    moe = _costs(CURVES["moe"])
    eq12 = select_b_ver(dict(CURVES["moe"]), 10.8, 0.1)   # the table's own rule keeps the floor's 8
    assert eq12 == 8
    keep = select_nodes(certain, parents, valid, depth, 256, floor="best_child", costs=moe)
    assert int(keep.sum()) == 240   # every node (B * T = 240 <= 256): 248 / 32.5 beats 8 + 8 at 16.6
    hopeless = rho * 30
    keep = select_nodes(hopeless, parents, valid, depth, 256, floor="best_child", costs=moe)
    assert int(keep.sum()) == B    # the floor alone: each extra node costs time and brings ~nothing
    # on the linear curve even certain drafts gain nothing past the smallest capacity (8 + 8 per 8 ms)
    keep = select_nodes(certain, parents, valid, depth, 256, floor="best_child", costs=_costs(CURVES["linear"]))
    assert int(keep.sum()) == 8


def test_goodput_costs_and_the_rule_option():
    from bole.config import SpecConfig

    assert goodput_costs({64: 3.0, 8: 1.0, 16: 2.0}) == [(8, 1.0), (16, 2.0), (64, 3.0)]
    with pytest.raises(ValueError, match="timed capacities"):
        goodput_costs({})
    with pytest.raises(ValueError, match="timed capacities"):
        goodput_costs({8 * (i + 1): 1.0 + i for i in range(17)})
    # each capacity's drafts per request: the width its even split over the batch pads to, less the root
    pairs = [(8, 1.0), (64, 2.0), (256, 3.0)]
    assert goodput_rows(pairs, 16, [8, 16, 32, 65], 64, True) == [(8, 1.0, 7), (64, 2.0, 7), (256, 3.0, 31)]
    assert goodput_rows(pairs, 16, [8, 16, 32, 65], 15, True) == [(8, 1.0, 7), (64, 2.0, 7), (256, 3.0, 15)]
    assert goodput_rows(pairs, 1, [8, 16, 32, 65], 64, True) == [(8, 1.0, 15), (64, 2.0, 64), (256, 3.0, 64)]
    assert goodput_rows(pairs, 16, [8, 16, 32, 65], 40, False) == [(8, 1.0, 40), (64, 2.0, 40), (256, 3.0, 40)]
    with pytest.raises(ValueError, match="budget_rule"):
        SpecConfig(budget_rule="throughput")
    default = CalibrationTable.load(REPO / "calibration_tables" / "default.yaml")
    with pytest.raises(ValueError, match="default.*without timings.*goodput"):
        default.require_timings("budget_rule='goodput' chooses each step's B_ver from them")


def test_auto_budget_rule_by_model_kind():
    """budget_rule="auto" (the default): goodput for a routed-expert model whose table feeds it, eq. 12's
    for a dense model or a table that cannot (no timings; more capacities than a cost row holds); the
    explicit rules stay themselves whatever the model."""
    from bole.config import SpecConfig

    assert SpecConfig().budget_rule == "auto"
    timed = CalibrationTable.load(REPO / "calibration_tables" / "cpu-bole-tiny-coder.yaml")
    default = CalibrationTable.load(REPO / "calibration_tables" / "default.yaml")
    wide = timed.to_dict()
    for b in wide["buckets"]:
        b["t_ver_ms"] = {8 * (i + 1): 1.0 + i for i in range(GOODPUT_SLOTS + 1)}
        b["b_ver"] = select_b_ver(b["t_ver_ms"], b["t_dec_ms"], wide["epsilon"])
    wide["capture_set"] = sorted(wide["buckets"][0]["t_ver_ms"])
    wide = CalibrationTable.from_dict(wide)
    assert resolve_budget_rule("auto", True, timed) == "goodput"
    assert [resolve_budget_rule("auto", moe, t) for moe, t in [(False, timed), (True, default), (True, wide)]] \
        == ["epsilon"] * 3
    for rule in ("epsilon", "goodput"):
        assert all(resolve_budget_rule(rule, moe, timed) == rule for moe in (False, True))


def test_selection_reads_nothing_on_the_host():
    """The draft graph captures ``select_nodes``: with ``b_ver`` and the cap device tensors, neither rule may
    read a tensor on the host (a CUDA graph capture fails on it). On the meta device any such read raises;
    indexing with a 0-d tensor is one, which the goodput rule's first version did and the GPU refused."""
    B, T = 4, 24
    rho, parents, valid, depth = _forest(B, T, 2)
    meta = lambda t: t.to("meta")
    for costs in (None, _costs(CURVES["moe"])):
        chosen = None if costs is None else meta(torch.zeros((), dtype=torch.long))
        keep = select_nodes(meta(rho), meta(parents), meta(valid), meta(depth), meta(torch.tensor(64)),
                            meta(torch.tensor(7)), floor="best_child", costs=None if costs is None else meta(costs),
                            chosen=chosen)
        assert keep.shape == (B, T) and keep.device.type == "meta"
