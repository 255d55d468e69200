"""The drafter's reduced vocabulary: the option, the frequency file and the embedded model's list."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import make_checkpoint
from engine_helpers import default_table, meta_model
from torch.utils._python_dispatch import TorchDispatchMode

from bole.config import EngineConfig, SpecConfig
from bole.engine.engine import LLMEngine
from bole.llm import resolve_repo_path
from bole.models.loader import load_model
from bole.models.qwen3_5 import HybridForCausalLM
from bole.spec.draft_vocab import FREQUENCIES_FILE, read_draft_vocab


@pytest.mark.parametrize("bad", [0, -3, 2, True, 8.0, "64"])
def test_spec_config_refuses_bad_draft_vocab(bad):
    with pytest.raises(ValueError, match="draft_vocab"):
        SpecConfig(topk=4, draft_vocab=bad)
    assert SpecConfig(topk=4, draft_vocab=4).draft_vocab == 4


def _write(tmp_path, content: str) -> str:
    (tmp_path / FREQUENCIES_FILE).write_text(content)
    return str(tmp_path)


def test_read_draft_vocab_takes_the_first_ids_capped_at_the_vocabulary(tmp_path):
    folder = _write(tmp_path, json.dumps({"token_ids": [5, 0, 7, 2, 1, 3, 4, 6]}))
    assert read_draft_vocab(folder, 3, 8) == [5, 0, 7]
    assert read_draft_vocab(folder, 100, 8) == [5, 0, 7, 2, 1, 3, 4, 6]


@pytest.mark.parametrize("content, match", [
    ("{not json", "not a token frequency list"),
    (json.dumps({"counts": [3, 2]}), "not a token frequency list"),
    (json.dumps({"token_ids": "0 1 2"}), "must be a list"),
    (json.dumps({"token_ids": [0, 1]}), "at least 3 ids"),
    (json.dumps({"token_ids": [0, 1, 8]}), r"\[0, vocab_size=8\)"),
    (json.dumps({"token_ids": [0, 1.0, 2]}), "must be ints"),
    (json.dumps({"token_ids": [0, 1, 1]}), "repeat"),
])
def test_read_draft_vocab_names_a_malformed_file(tmp_path, content, match):
    folder = _write(tmp_path, content)
    with pytest.raises(ValueError, match=match) as e:
        read_draft_vocab(folder, 3, 8)
    assert FREQUENCIES_FILE in str(e.value)


def test_read_draft_vocab_names_a_missing_file_and_a_bad_n(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}/{FREQUENCIES_FILE}.*does not exist"):
        read_draft_vocab(str(tmp_path), 3, 8)
    with pytest.raises(ValueError, match="not loaded from one"):
        read_draft_vocab(None, 3, 8)
    with pytest.raises(ValueError, match="draft_vocab must be an int >= 1, got 0"):
        read_draft_vocab(str(tmp_path), 0, 8)


def test_engine_refuses_draft_vocab_without_the_file(tmp_path):
    make_checkpoint(tmp_path, "dense", 16)
    cfg = EngineConfig.from_options(mode="bole", calibration_table=default_table(), num_blocks=32, block_size=4,
                                    topk=2, draft_vocab=8)
    with pytest.raises(ValueError, match=FREQUENCIES_FILE):
        LLMEngine(load_model(str(tmp_path), dtype="float32"), cfg)


def test_restrict_vocab_scores_the_gathered_rows():
    torch.manual_seed(0)  # the helper's small config, on the CPU with an MTP layer
    model = HybridForCausalLM(meta_model().config, backend="torch", num_mtp_layers=1)
    mtp, ids = model.mtp, [9, 2, 40, 17]
    h = torch.randn(3, model.config.hidden_size)
    full = mtp.compute_logits(h)
    mtp.restrict_vocab(ids)
    assert mtp.vocab_width == 4 and mtp._vocab_weight.is_contiguous()
    torch.testing.assert_close(mtp.compute_logits(h), full[:, ids])
    lp, tok = mtp.log_softmax_topk(mtp.compute_logits(h), 2)
    ref = full[:, ids].log_softmax(-1).topk(2, -1)
    torch.testing.assert_close(lp, ref.values)
    assert tok.tolist() == torch.tensor(ids)[ref.indices].tolist()
    mtp.restrict_vocab(None)
    assert mtp.vocab_width == model.config.vocab_size


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ids", [None, [9, 2, 40, 17]])
def test_draft_logits_of_a_strided_frontier_are_one_gemm(ids):
    # The frontier [B, M, H] sliced out of the drafter's forest buffer is strided. F.linear on it against a
    # weight that needs no grad (the reduced vocabulary's gathered rows) runs a bmm with the weight expanded
    # per request, reading it B times (the 8-row-tile GEMMs of the 9B-cost batch-16 profile);
    # compute_logits runs one mm whatever the input's strides.
    torch.manual_seed(0)
    model = HybridForCausalLM(meta_model().config, backend="torch", num_mtp_layers=1)
    mtp = model.mtp
    mtp.restrict_vocab(ids)
    weight = mtp._shared[1].weight if ids is None else mtp._vocab_weight
    h = torch.randn(3, 7, model.config.hidden_size)[:, 4:]
    assert not h.is_contiguous()
    with torch.no_grad():
        if ids is not None:  # what compute_logits avoids
            assert "bmm" in _ops_of(lambda: torch.nn.functional.linear(h, weight))
        ops = _ops_of(lambda: mtp.compute_logits(h))
        assert ops.count("mm") == 1 and "bmm" not in ops, ops
        out = mtp.compute_logits(h)
    assert out.shape == (3, 3, mtp.vocab_width)
    torch.testing.assert_close(out.double(), h.double() @ weight.double().T, rtol=1e-5, atol=1e-5)
    for b in range(3):  # each request's rows alone: the same logits
        torch.testing.assert_close(out[b], mtp.compute_logits(h[b].clone()))


def _ops_of(fn) -> list[str]:
    with _Ops() as rec:
        fn()
    return rec.ops


def test_embedded_model_frequency_list_is_a_ranking_of_the_train_split():
    folder = resolve_repo_path("models/bole-tiny-coder")
    with open(os.path.join(folder, FREQUENCIES_FILE)) as fh:
        table = json.load(fh)
    V = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    assert sorted(table["token_ids"]) == list(range(V))            # every id once
    counts = table["counts"]
    assert counts == sorted(counts, reverse=True) and sum(counts) == table["total_tokens"] > 1_000_000
    assert table["source"]["split"] == "train"
    assert read_draft_vocab(folder, 1024, V) == table["token_ids"][:1024]
