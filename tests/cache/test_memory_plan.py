"""The memory plan (bole.cache.memory_plan) as a pure function at Qwen3.5-9B / 27B shapes with made-up
free-memory figures, the option's validation, and the engine on the embedded model reporting its plan."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
import torch

from bole.cache.kv_cache import PagedKVCache, blocks_needed
from bole.cache.memory_plan import CATEGORIES, GiB, plan_memory
from bole.cache.state_pool import StatePool
from bole.calibrate_sweep import shapes_config
from bole.config import CacheConfig, EngineConfig
from bole.engine.engine import LLMEngine
from bole.llm import resolve_repo_path
from bole.models.context import TreeFactors
from bole.models.loader import load_model
from bole.spec.drafter import tree_size

TOTAL = 140 * GiB
SIZE = lambda t: t.numel() * t.element_size()


def shapes(name: str, positions: int = 262144):
    """The sweep's shapes with one MTP layer and Qwen3.5's 262144 positions (the planned KV's cap)."""
    return replace(shapes_config(name), num_mtp_layers=1, max_position_embeddings=positions)


def cuda_config(mode: str, **opts) -> EngineConfig:
    return EngineConfig.from_options(mode=mode, device="cuda", dtype="bfloat16", **opts)


@pytest.mark.parametrize("name", ["qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b"])
@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_numbers_add_up_within_the_budget(name, mode):
    cfg, config = shapes(name), cuda_config(mode, max_num_seqs=8)
    free = TOTAL - 60 * GiB
    plan = plan_memory(cfg, config, free, TOTAL)
    assert plan.planned and plan.budget == int(0.9 * TOTAL) - (TOTAL - free)
    assert plan.total_bytes == sum(plan.categories().values()) and set(plan.categories()) == set(CATEGORIES)
    assert plan.total_bytes <= plan.budget
    # the leftover is less than one KV block: every byte not otherwise needed went to KV blocks
    kv = PagedKVCache(cfg.num_attn_layers + 1, 1, 16, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "meta")
    assert plan.budget - plan.total_bytes < SIZE(kv.kv)
    assert plan.kv == plan.num_blocks * SIZE(kv.kv)
    pool = StatePool.for_model(cfg, 1, conv_dtype=torch.bfloat16, device="meta")
    slot = SIZE(pool.ssm) + SIZE(pool.conv)
    assert plan.state == (8 + 1) * slot and plan.num_state_slots == 9
    assert plan.checkpoints == (plan.num_checkpoint_slots + 1) * slot and plan.num_checkpoint_slots >= 1
    nodes = 8 * (1 + (tree_size(cfg.vocab_size, 4, 4, 4) if mode == "bole" else 0))
    per = TreeFactors.transient_bytes(cfg, nodes, torch.bfloat16)
    assert plan.factors == per["factors"] + per["conv_inputs"] and plan.snapshots == 0
    assert plan.max_num_seqs_fit >= 8


@pytest.mark.parametrize("name", ["qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b"])
def test_serial_tree_snapshots_cost_blocks_and_sequences(name):
    cfg, free = shapes(name), TOTAL - 60 * GiB
    bole = plan_memory(cfg, cuda_config("bole", max_num_seqs=4), free, TOTAL)
    serial = plan_memory(cfg, cuda_config("serial_tree", max_num_seqs=4), free, TOTAL)
    nodes = 4 * (1 + tree_size(cfg.vocab_size, 4, 4, 4))
    snaps = TreeFactors.transient_bytes(cfg, nodes, torch.bfloat16)["snapshots"]
    assert serial.snapshots == snaps == nodes * cfg.num_gdn_layers * cfg.linear_num_value_heads * 128 * 128 * 4
    assert serial.num_blocks < bole.num_blocks and serial.max_num_seqs_fit < bole.max_num_seqs_fit
    assert serial.factors == bole.factors and serial.total_bytes <= serial.budget


def test_refusal_says_what_fits():
    cfg, free = shapes("qwen3.5-9b"), 40 * GiB
    with pytest.raises(ValueError) as e:
        plan_memory(cfg, cuda_config("serial_tree", max_num_seqs=32), free, TOTAL)
    msg = str(e.value)
    fit = plan_memory(cfg, cuda_config("serial_tree", max_num_seqs=1), free, TOTAL).max_num_seqs_fit
    assert 1 <= fit < 32
    assert f"at most {fit} fit" in msg and "max_num_seqs=32 with serial_tree" in msg
    assert "snapshot buffers" in msg and "mode='bole'" in msg and "gpu_memory_utilization=0.9" in msg
    # the number it names does fit, one more does not
    plan_memory(cfg, cuda_config("serial_tree", max_num_seqs=fit), free, TOTAL)
    with pytest.raises(ValueError, match=f"at most {fit} fit"):
        plan_memory(cfg, cuda_config("serial_tree", max_num_seqs=fit + 1), free, TOTAL)


def test_explicit_counts_win_but_are_checked():
    cfg, free = shapes("qwen3.5-9b"), 60 * GiB
    plan = plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=1000, num_checkpoint_slots=5), free, TOTAL)
    assert (plan.num_blocks, plan.num_checkpoint_slots) == (1000, 5)
    auto = plan_memory(cfg, cuda_config("bole", max_num_seqs=8), free, TOTAL)
    assert plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=auto.num_blocks), free, TOTAL).kv == auto.kv
    with pytest.raises(ValueError, match=r"num_blocks=1000000 needs .* GiB of KV cache; at most \d+ blocks fit") as e:
        plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=10 ** 6), free, TOTAL)
    most = int(re.search(r"at most (\d+) blocks fit", str(e.value)).group(1))
    # a given num_blocks may take the planned checkpoints' share (they shrink to one slot); the number named fits
    assert most > auto.num_blocks
    big = plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=most), free, TOTAL)
    assert big.num_checkpoint_slots == 1 and big.total_bytes <= big.budget
    with pytest.raises(ValueError, match=f"num_blocks={most + 1} needs"):
        plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=most + 1), free, TOTAL)
    with pytest.raises(ValueError, match="num_checkpoint_slots=5000 leaves fewer KV blocks") as e:
        plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_checkpoint_slots=5000), free, TOTAL)
    most = int(re.search(r"at most (\d+) checkpoint slots fit", str(e.value)).group(1))
    assert most > auto.num_checkpoint_slots
    plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_checkpoint_slots=most), free, TOTAL)
    with pytest.raises(ValueError, match=f"num_checkpoint_slots={most + 1} leaves"):
        plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_checkpoint_slots=most + 1), free, TOTAL)


def test_short_context_caps_the_planned_kv():
    cfg, config = shapes("qwen3.5-9b", positions=4096), cuda_config("bole", max_num_seqs=8)
    plan = plan_memory(cfg, config, TOTAL - 20 * GiB, TOTAL)
    lookahead = 1 + tree_size(cfg.vocab_size, 4, 4, 4)
    assert plan.num_blocks == 2 * 8 * blocks_needed(4096 + lookahead, 16)
    assert plan.num_checkpoint_slots <= plan.num_blocks and plan.total_bytes < plan.budget / 2
    # a count given is not capped
    assert plan_memory(cfg, cuda_config("bole", max_num_seqs=8, num_blocks=3 * plan.num_blocks), TOTAL - 20 * GiB,
                       TOTAL).num_blocks == 3 * plan.num_blocks


def test_utilization_bounds_the_budget():
    cfg, config = shapes("qwen3.5-9b"), cuda_config("bole", max_num_seqs=8)
    lo = plan_memory(cfg, replace(config, cache=replace(config.cache, gpu_memory_utilization=0.6)), 100 * GiB, TOTAL)
    hi = plan_memory(cfg, config, 100 * GiB, TOTAL)
    assert lo.budget == int(0.6 * TOTAL) - 40 * GiB and lo.num_blocks < hi.num_blocks
    with pytest.raises(ValueError, match="at most 0 fit"):  # 0.2 x total is less than what is in use
        plan_memory(cfg, replace(config, cache=replace(config.cache, gpu_memory_utilization=0.2)), 100 * GiB, TOTAL)


def test_cpu_keeps_the_configured_counts():
    cfg = shapes("qwen3.5-9b")
    plan = plan_memory(cfg, EngineConfig.from_options(mode="bole", device="cpu"))
    assert not plan.planned and (plan.num_blocks, plan.num_checkpoint_slots) == (512, 32)
    plan = plan_memory(cfg, EngineConfig.from_options(mode="bole", device="cpu", num_blocks=7, num_checkpoint_slots=3))
    assert (plan.num_blocks, plan.num_checkpoint_slots, plan.max_num_seqs_fit) == (7, 3, None)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, float("nan"), "0.9", True, None])
def test_gpu_memory_utilization_is_validated(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_options(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=bad)


def test_counts_are_validated_when_given():
    assert CacheConfig(gpu_memory_utilization=1).num_blocks is None
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_blocks"):
            CacheConfig(num_blocks=bad)
        with pytest.raises(ValueError, match="num_checkpoint_slots"):
            CacheConfig(num_checkpoint_slots=bad)


@pytest.mark.parametrize("mode", ["bole", "serial_tree"])
def test_engine_reports_its_plan(mode, caplog):
    model = load_model(resolve_repo_path("models/bole-tiny-coder"), dtype="float32")
    config = EngineConfig.from_options(mode=mode, device="cpu", max_num_seqs=2, depth=2, topk=2, beam=2,
                                       calibration_table=resolve_repo_path("calibration_tables/default.yaml"))
    with caplog.at_level(logging.INFO, logger="bole.cache.memory_plan"):
        eng = LLMEngine(model, config)
    plan = eng.memory_plan
    assert not plan.planned and eng.config.cache.num_blocks == plan.num_blocks == 512
    assert eng.config.cache.num_checkpoint_slots == plan.num_checkpoint_slots == 32
    # the plan's bytes are the buffers the engine built
    r = eng.runner
    assert plan.kv == SIZE(r.kv_cache.kv) + SIZE(r.mtp_cache.kv)
    assert plan.state == SIZE(r.state_pool.ssm) + SIZE(r.state_pool.conv)
    cp = eng.prefix_cache.checkpoints
    assert plan.checkpoints == SIZE(cp.ssm) + SIZE(cp.conv)
    f = r.factors
    assert plan.factors == sum(SIZE(t) for t in (f.k, f.u, f.logp, f.conv_x))
    assert plan.snapshots == (SIZE(f.snapshots) if mode == "serial_tree" else 0) and (plan.snapshots > 0) == \
        (mode == "serial_tree")
    assert eng.limits().memory_plan == plan.categories()
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0].startswith("memory plan on cpu") and len(logged) == 1 + len(CATEGORIES)
    assert all(any(line.split()[0] == c for line in logged[1:]) for c in CATEGORIES)


def test_prefill_graph_buckets_past_the_token_budget_are_planned():
    """A captured prefill runs over its whole token bucket: with graphs, the activations are planned for
    the largest bucket when it exceeds max_num_batched_tokens (here 300 tokens + padding -> 512)."""
    cfg, free = shapes("qwen3.5-9b"), TOTAL - 60 * GiB
    opts = dict(max_num_seqs=8, max_num_batched_tokens=300, cuda_graph_prefill_tokens=1024)
    eager = plan_memory(cfg, cuda_config("bole", **opts), free, TOTAL)
    graphed = plan_memory(cfg, cuda_config("bole", enable_cuda_graphs=True, **opts), free, TOTAL)
    assert cuda_config("bole", **opts).prefill_graph_tokens[-1] == 512
    per_token = cfg.hidden_size * 24 * 2   # ACTIVATION_WIDTHS bf16 widths
    assert graphed.activations - eager.activations >= (512 - 300) * per_token
    within = dict(opts, max_num_batched_tokens=1024, cuda_graph_prefill_tokens=512)   # 512 <= 1024: as eager
    assert plan_memory(cfg, cuda_config("bole", enable_cuda_graphs=True, **within), free, TOTAL).activations == \
        plan_memory(cfg, cuda_config("bole", **within), free, TOTAL).activations


def test_prefills_beside_the_forward_are_planned():
    """``admit_during_forward``: a prefill runs beside the step's forward, on a stream whose cached blocks the
    other stream never reuses: twice one forward's activations, and the prefill's logits beside the verify's."""
    from bole.cache.memory_plan import LOGITS_FP32_COPIES, LOGITS_NATIVE_COPIES

    cfg, free = shapes("qwen3.5-9b"), TOTAL - 60 * GiB
    opts = dict(max_num_seqs=8, max_num_batched_tokens=512, max_verify_rows=256, enable_cuda_graphs=True)
    for mode, rows in (("ar", 8 + 512), ("bole", 256 + 512)):   # ar's decode rows: one a sequence
        alone = plan_memory(cfg, cuda_config(mode, **opts), free, TOTAL)
        beside = plan_memory(cfg, cuda_config(mode, admit_during_forward=True, **opts), free, TOTAL)
        assert beside.activations == 2 * alone.activations
        assert beside.logits == rows * cfg.vocab_size * (LOGITS_NATIVE_COPIES * 2 + LOGITS_FP32_COPIES * 4)
        assert beside.num_blocks < alone.num_blocks and beside.total_bytes <= beside.budget
        # without mid-step admissions nothing runs beside: as planned before
        off = plan_memory(cfg, cuda_config(mode, admit_during_forward=True, admit_mid_step=False, **opts), free, TOTAL)
        assert (off.activations, off.logits) == (alone.activations, alone.logits)


def test_the_refusal_names_the_option_that_shrinks_the_largest_buffer():
    """Verify logits are sized by the larger of the verify rows and max_num_batched_tokens: at bole's default
    (rows = the token budget) or below it, lowering max_verify_rows frees nothing, so the refusal names the
    token budget; above it, the rows, with their floor."""
    cfg, total = shapes("qwen3.5-9b"), int(80 * GiB)
    free = int(3.5 * GiB) + int(0.1 * total)   # 3.5 GiB left under gpu_memory_utilization=0.9
    opts = dict(max_num_seqs=32, depth=8, topk=4, beam=4)
    for rows in (None, 256):
        with pytest.raises(ValueError, match=r"3\.32 GiB of verify logits") as e:
            plan_memory(cfg, cuda_config("bole", max_verify_rows=rows, **opts), free, total)
        assert "lower max_num_batched_tokens (now 1024" in str(e.value) and "max_verify_rows" not in str(e.value)
    with pytest.raises(ValueError, match=r"6\.63 GiB of verify logits") as e:
        plan_memory(cfg, cuda_config("bole", max_verify_rows=2048, **opts), free, total)
    assert "(max_verify_rows; now 2048, at least 256)" in str(e.value) and "max_num_batched_tokens" not in str(e.value)


def test_the_moe_shape_on_an_80_gb_card_is_refused_with_the_token_budget_named_and_fits_below_it():
    """The 35B-A3B MoE shape's 66.1 GiB of weights leave ~5 GiB of an 80 GB card's 0.9 budget: the logits
    of the widest lm_head call (1,024 rows x a 248,320-token vocabulary, 3.32 GiB) do not fit beside the rest
    in either mode. ar's are a prefill's (every row of a chunk, for prompt logprobs), not a verify's, and
    only max_num_batched_tokens shrinks them; at 512 both modes fit to max_num_seqs 16."""
    from bole.cache.memory_plan import LOGITS_FP32_COPIES, LOGITS_NATIVE_COPIES

    cfg = shapes("qwen3.5-35b-a3b", positions=32768)   # the sweep's context (the widened grid model's)
    total = 81559 * 2**20   # what an H100 80GB reports
    free = total - 71_010_502_912 - 512 * 2**20   # beside the bf16 weights and a CUDA context
    opts = dict(max_num_seqs=1, depth=8, topk=4, beam=4)
    for mode, what in (("ar", "prefill"), ("bole", "verify")):
        with pytest.raises(ValueError, match=rf"with {mode} needs .* \(3\.32 GiB of {what} logits") as e:
            plan_memory(cfg, cuda_config(mode, **opts), free, total)
        assert "lower max_num_batched_tokens (now 1024: the widest lm_head call, a prefill's" in str(e.value)
        for seqs in (1, 16):
            plan = plan_memory(cfg, cuda_config(mode, **dict(opts, max_num_seqs=seqs), max_num_batched_tokens=512),
                               free, total)
            assert plan.num_blocks > 0 and plan.total_bytes <= plan.budget
            assert plan.logits == 512 * cfg.vocab_size * (LOGITS_NATIVE_COPIES * 2 + LOGITS_FP32_COPIES * 4)


def test_verify_rows_size_the_speculative_buffers():
    """The 27B shape at batch 32 beside its weights on an 80 GB card (the H100 run that refused it before
    the default bounded the rows): whole trees for every request plan 12.1 GiB of verify logits and do not
    fit, the refusal names the option; the default, the step's token budget (1024 rows), fits."""
    from bole.cache.memory_plan import LOGITS_FP32_COPIES, LOGITS_NATIVE_COPIES
    from bole.spec.budget import engine_verify_rows

    cfg, total = shapes("qwen3.5-27b", positions=4096), int(79.18 * GiB)   # the widened model keeps 4096
    free = total - int(54.58 * GiB)
    opts = dict(max_num_seqs=32, depth=8, topk=4, beam=4)
    whole = 32 * 117   # every request's whole tree: 117 nodes with its root
    with pytest.raises(ValueError, match=r"max_num_seqs=32 with bole needs .* GiB \(12\.\d+ GiB of verify logits") as e:
        plan_memory(cfg, cuda_config("bole", max_verify_rows=whole, **opts), free, total)
    assert f"(max_verify_rows; now {whole}, at least 256)" in str(e.value)
    for rows in (None, 1024):
        plan = plan_memory(cfg, cuda_config("bole", max_verify_rows=rows, **opts), free, total)
        row = cfg.vocab_size * (LOGITS_NATIVE_COPIES * 2 + LOGITS_FP32_COPIES * 4)
        per = TreeFactors.transient_bytes(cfg, 1024, torch.bfloat16)
        assert plan.logits == 1024 * row and plan.factors == per["factors"] + per["conv_inputs"]
        assert plan.max_num_seqs_fit >= 32 and plan.total_bytes <= plan.budget
        assert plan.verify_rows == 1024 and "(1024 verify rows)" in "\n".join(plan.lines())
    # the default follows the token budget, and is raised to the fairness floor's rows (32 trees of 8)
    assert plan_memory(cfg, cuda_config("bole", max_num_batched_tokens=512, **opts), free, total).verify_rows == 512
    assert plan_memory(cfg, cuda_config("bole", max_num_batched_tokens=128, **opts), free, total).verify_rows == 256
    # serial_tree plans every request's whole tree unless told otherwise: its snapshots are the baseline's cost
    assert engine_verify_rows(cuda_config("serial_tree", **opts), 32, 117) == whole
    assert engine_verify_rows(cuda_config("serial_tree", max_verify_rows=1024, **opts), 32, 117) == 1024
    # serial_tree's refusal names its snapshots, not the rows
    with pytest.raises(ValueError, match="snapshot buffers") as e:
        plan_memory(cfg, cuda_config("serial_tree", **opts), free, total)
    assert "max_verify_rows" not in str(e.value)
