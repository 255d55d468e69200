"""The drafter's reduced vocabulary: the option, the frequency file and the embedded model's list."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import make_checkpoint
from engine_helpers import default_table, meta_model

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
