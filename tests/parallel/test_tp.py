"""Tensor parallelism on CPU: two processes joined by gloo on 127.0.0.1 (SPMD engines, bole.parallel).

TP=2 greedy outputs must equal TP=1's token for token in ``ar`` and ``bole`` modes, and prefill
logits must agree within 1e-5, for a checkpoint whose heads split evenly and for one whose KV heads
and GDN key heads (1 each) are replicated across the ranks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoints import make_checkpoint  # noqa: E402
from tp_worker import run_case, tp_main  # noqa: E402

from bole.config import ModelConfig  # noqa: E402
from bole.parallel import free_port, head_range, local_model_config  # noqa: E402

MODES = ("ar", "bole")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    even = tmp_path_factory.mktemp("tp_even")
    make_checkpoint(even, "dense", vocab_size=32)
    # 1 KV head and 1 GDN key head over 2 ranks: both replicated
    repl = tmp_path_factory.mktemp("tp_replicated")
    make_checkpoint(repl, "dense", vocab_size=32, seed=1, num_key_value_heads=1, linear_num_key_heads=1)
    return {"even": str(even), "replicated": str(repl)}


def test_head_range_splits_or_replicates():
    assert [head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="tp_size=3"):
        head_range(2, 3, 0)


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    import socket

    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    if lo <= 21000:
        pytest.skip(f"ephemeral range starts at {lo}: free_port falls back to bind(0)")
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < lo for p in ports), ports
    with socket.socket() as s:  # free right now
        s.bind(("127.0.0.1", ports.pop()))


def test_tp2_matches_tp1(checkpoints, tmp_path):
    cases = [(checkpoints[kind], mode) for kind in ("even", "replicated") for mode in MODES]
    ref = [run_case(path, mode) for path, mode in cases]
    mp.spawn(tp_main, args=(2, free_port(), cases, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, (path, mode) in enumerate(cases):
        what = f"{os.path.basename(path)}/{mode}"
        assert ranks[0][i]["tokens"] == ranks[1][i]["tokens"], f"{what}: the ranks diverged"
        assert ranks[0][i]["tokens"] == ref[i]["tokens"], f"{what}: TP=2 differs from TP=1"
        assert ranks[0][i]["steps"] == ref[i]["steps"]
        if mode == "ar":
            a, b = ranks[0][i]["logits"], ref[i]["logits"]
            assert a.shape == b.shape
            assert (a - b).abs().max().item() <= 1e-5, what
            assert torch.equal(ranks[0][i]["logits"], ranks[1][i]["logits"])


def test_local_config_sizes_caches(checkpoints):
    from bole.models.loader import read_config

    _, cfg = read_config(checkpoints["replicated"])
    local = local_model_config(cfg, 2)
    assert isinstance(local, ModelConfig)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert local.conv_dim == 2 * 16 + 2 * 8
