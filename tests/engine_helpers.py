"""Helpers shared by the engine test modules (importable like ``checkpoints``)."""

from __future__ import annotations

from bole.llm import resolve_repo_path
from bole.sampling_params import SamplingParams


def default_table() -> str:
    """The repository's default calibration table (unmeasured defaults: every engine test uses it)."""
    return resolve_repo_path("calibration_tables/default.yaml")


def tiny_engine(path, mode, **opts):
    """An engine over the checkpoint at ``path`` with the engine tests' small cache and tree (options
    override them), the model loaded on the config's device."""
    from bole.config import EngineConfig
    from bole.engine.engine import LLMEngine
    from bole.models.loader import load_model

    opts = {"num_blocks": 96, "block_size": 4, "depth": 3, "topk": 3, "beam": 3, "max_num_seqs": 4,
            "max_num_batched_tokens": 16, **opts}
    cfg = EngineConfig.from_options(mode=mode, calibration_table=default_table(), **opts)
    return LLMEngine(load_model(path, dtype="float32", device=cfg.device), cfg)


def run_arrivals(eng, prompts, max_tokens) -> list[list[int]]:
    """Greedy requests arriving one per step (batch sizes vary); each request's output tokens."""
    ids, outs = [], {}
    pending = list(zip(prompts, max_tokens))
    while pending or eng.has_unfinished():
        if pending:
            p, n = pending.pop(0)
            ids.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    return [outs[i] for i in ids]


def meta_model():
    """A small hybrid model (3 GDN layers + 1 attention layer, torch twins, no MTP) on the meta device:
    any host read of a device value raises there, so a forward run on it proves it is sync-free."""
    import torch

    from bole.config import ModelConfig
    from bole.models.qwen3_5 import HybridForCausalLM

    cfg = ModelConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
                      layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=1e4, partial_rotary_factor=0.25,
                      attention_bias=False, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                      gdn_layout="split", intermediate_size=64)
    with torch.device("meta"):
        return HybridForCausalLM(cfg, backend="torch", num_mtp_layers=0)


def reference_penalty(row: list[float], output: list[int], prompt: list[int], rep: float, freq: float,
                      pres: float):
    """vLLM's penalty rule token by token in Python (the naive reference): repetition over prompt + output
    (divide a positive logit, multiply a negative one), then frequency * count and presence over the output."""
    import torch

    out = []
    for v, x in enumerate(row):
        n = output.count(v)
        if n > 0 or v in prompt:
            x = x / rep if x > 0 else x * rep
        out.append(x - freq * n - pres * (n > 0))
    return torch.tensor(out)


def uncaptured_spec_graphs(eng, sizes, prefill: bool = False, **kw):
    """Build ``eng``'s verify and draft graph families (and with ``prefill`` its prefill graphs) uncaptured,
    as ``LLMEngine`` wires them on a GPU (checkpoints included): on the CPU their static paths run. ``kw``
    (``min_kv``...) goes to each family; returns the verify family."""
    from bole.spec.tree import MAX_TREE_NODES, tree_widths

    cfg, spec, runner = eng.config, eng.config.spec, eng.runner
    vg = runner.enable_verify_graphs(sizes, tree_widths(eng.lookahead), spec.depth + 1, capture=False, **kw)
    runner.enable_draft_graphs(sizes, spec.depth, spec.topk, spec.beam, capture=False,
                               max_per_request=MAX_TREE_NODES - 1, floor=spec.budget_floor, **kw)
    if eng.prefix_cache is not None:
        vg.enable_checkpoints(eng.prefix_cache.checkpoints, cfg.cache.checkpoint_interval,
                              eng.prefix_cache.scratch_slot)
    if prefill:
        runner.enable_prefill_graphs(sizes, capture=False, token_sizes=cfg.prefill_graph_tokens, **kw)
        if eng.prefix_cache is not None:
            runner.enable_prefill_checkpoints(eng.prefix_cache.checkpoints)
    return vg
