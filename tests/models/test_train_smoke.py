"""CPU smoke test of the bole-tiny-coder training pipeline (scripts/train_tiny.py --smoke).

Trains a tiny Qwen3.5-text + MTP model for a few steps in a subprocess, then checks that the saved
folder is a Hugging Face checkpoint that ``AutoModelForCausalLM`` loads (with the ``mtp.*``
tensors in ``model.safetensors``, named and shaped like Qwen3.5 checkpoints), that the MTP tensors
load back into the training-time MTP module, and that the full-size configuration meets the
issue-6 constraints (>= 16 layers, 15-40M parameters, MTP <= 1/16 of the target, <= 80 MB bf16).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_tiny.py"
TOKENIZER_DIR = REPO / "models" / "bole-tiny-coder"

MTP_SUFFIXES = {
    "fc.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR / "tokenizer.json").exists(), reason="run scripts/prepare_data.py first (tokenizer)"
)


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bole_tiny_smoke")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_smoke_outputs(smoke_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "training_log.json",
                 "README.md", "tokenizer.json", "tokenizer_config.json"):
        assert (smoke_dir / name).exists(), name
    cfg = json.loads((smoke_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["mtp_num_hidden_layers"] == 1
    assert cfg["use_cache"] is True
    lt = cfg["layer_types"]
    assert lt == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(len(lt))]
    log = json.loads((smoke_dir / "training_log.json").read_text())
    res = log["result"]
    assert res["error"] is None and res["steps"] == 3
    assert torch.isfinite(torch.tensor(res["final_eval"]["heldout_loss_target"]))
    assert torch.isfinite(torch.tensor(res["final_eval"]["heldout_loss_mtp"]))
    assert "acceptance_rate" in res["greedy_acceptance"]


def test_mtp_tensors_in_safetensors(smoke_dir):
    from safetensors import safe_open

    cfg = json.loads((smoke_dir / "config.json").read_text())
    H = cfg["hidden_size"]
    with safe_open(str(smoke_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        mtp = {k[len("mtp."):] for k in keys if k.startswith("mtp.")}
        assert mtp == MTP_SUFFIXES
        assert list(f.get_slice("mtp.fc.weight").get_shape()) == [H, 2 * H]
        assert f.get_tensor("mtp.fc.weight").dtype == torch.bfloat16
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys

    # the names load back, strictly, into the training-time MTP module
    from transformers import AutoConfig

    tt = _load_script()
    mtp_mod = tt.MTP(AutoConfig.from_pretrained(smoke_dir))
    with safe_open(str(smoke_dir / "model.safetensors"), "pt") as f:
        sd = {k[len("mtp."):]: f.get_tensor(k).float() for k in keys if k.startswith("mtp.")}
    mtp_mod.load_state_dict(sd, strict=True)


def test_loads_with_auto_model_and_greedy_is_consistent(smoke_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(smoke_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    tok = AutoTokenizer.from_pretrained(smoke_dir)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id is not None
    model = model.float().eval()
    ids = torch.tensor([tok.encode("def add(a, b):\n    ")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        # the same greedy tokens without a cache (full recompute each step)
        seq = ids.clone()
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out[:, : seq.shape[1]], seq)


def test_full_config_meets_issue_constraints():
    from transformers import Qwen3_5ForCausalLM

    tt = _load_script()
    cfg = tt.make_config(tt.FULL, vocab_size=8192, eos_id=0, pad_id=3)
    assert cfg.num_hidden_layers >= 16
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
        mtp = tt.MTP(cfg)
    p = tt.count_params(model, mtp, cfg)
    assert 15e6 <= p["target_total"] <= 40e6, p
    assert p["mtp_total"] * 16 <= p["target_decoder_layers"], p
    assert p["total_with_mtp"] * 2 <= 80e6, p  # bf16 model.safetensors <= 80 MB
