"""The model on CUDA with the "auto" backend (Triton tree verifier and commit): parity with
transformers for prefill, decode, tree verification and commit.

The reference is transformers on the CPU, on its torch GDN path: on the GPU machine transformers
takes flash-linear-attention's chunked kernels wherever fla is importable (TF32 products), which made
the reference itself only TF32-grade (errors up to 7.8e-3 against it, 2026-12-02), and fla's Triton
kernels refuse CPU tensors."""

import inspect

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as hf_qwen3_5
import transformers.models.qwen3_next.modeling_qwen3_next as hf_next
from conftest import Runner, hf_logits, rel_err

from bole.models.loader import load_model
from bole.spec.tree import random_tree

pytestmark = pytest.mark.gpu
TOL = 1e-3  # fp32 on GPU: kernels may use TF32 dot products


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_cuda_auto_backend_parity(checkpoints, kind, monkeypatch):
    for mod in (hf_qwen3_5, hf_next):  # the torch GDN functions, not fla's behind them
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(mod, name, inspect.unwrap(getattr(mod, name)))
    rel = lambda ours, ref: rel_err(ours.cpu(), ref)
    ck = checkpoints(kind)
    hf = ck.hf.to("cpu")
    model = load_model(ck.path, dtype="float32", device="cuda", backend="auto")
    gen = torch.Generator().manual_seed(3)
    prompts = {0: torch.randint(0, 128, (70,), generator=gen).tolist(),
               1: torch.randint(0, 128, (9,), generator=gen).tolist()}
    r = Runner(model, device="cuda")
    for rid in prompts:
        r.add(rid)
    logits, _ = r.step("prefill", prompts)
    errs = {"prefill": max(rel(logits[:70], hf_logits(hf, prompts[0])),
                           rel(logits[70:], hf_logits(hf, prompts[1])))}
    seqs = {k: list(v) for k, v in prompts.items()}
    for _ in range(4):
        toks = {rid: [int(torch.randint(0, 128, (1,), generator=gen))] for rid in seqs}
        logits, _ = r.step("decode", toks)
        for j, rid in enumerate(seqs):
            seqs[rid] += toks[rid]
            errs["decode"] = max(errs.get("decode", 0), rel(logits[j], hf_logits(hf, seqs[rid])[-1]))
    trees = [random_tree(16, 5, generator=gen), random_tree(6, 3, generator=gen)]
    batch = {b: (list(t.parents), torch.randint(0, 128, (t.num_nodes,), generator=gen).tolist())
             for b, t in enumerate(trees)}
    logits, _, ctx = r.verify(batch)
    off = 0
    for b, t in enumerate(trees):
        for i in range(t.num_nodes):
            seq = seqs[b] + [batch[b][1][j] for j in t.path_to(i)]
            errs["verify"] = max(errs.get("verify", 0), rel(logits[off + i], hf_logits(hf, seq)[-1]))
        off += t.num_nodes
    accepted = [max(range(16), key=lambda i: len(trees[0].path_to(i))), 0]
    r.commit(ctx, [0, 1], accepted)
    for b, a in enumerate(accepted):
        seqs[b] += [batch[b][1][j] for j in trees[b].path_to(a)] + [7]
    logits, _ = r.step("decode", {0: [7], 1: [7]})
    errs["after_commit"] = max(rel(logits[b], hf_logits(hf, seqs[b])[-1]) for b in range(2))
    print(kind, model.backend.name, errs)
    assert model.backend.name == "triton"
    assert all(e <= TOL for e in errs.values()), errs
