"""Our top-level ``kernels`` package must not be mistaken for the PyPI ``kernels`` (Hugging Face hub
kernels) that transformers probes for (DESIGN.md §1, "Beware the name kernels").

transformers asks ``importlib.util.find_spec("kernels")`` and then a distribution version; a false
positive would make it ``from kernels import LayerRepository, ...`` at import time and fail. The check
runs in a fresh interpreter with the repository first on ``sys.path`` so that ``import kernels``
resolves to ours exactly as it does in the engine.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import os, sys, tempfile
sys.path.insert(0, os.environ["BOLE_REPO"])
import kernels
assert os.path.dirname(kernels.__file__) == os.path.join(os.environ["BOLE_REPO"], "kernels"), kernels.__file__

import torch
import transformers
from transformers.utils import import_utils
assert not import_utils.is_kernels_available(), "transformers thinks the hub 'kernels' package is installed"
import transformers.integrations.hub_kernels as hub_kernels  # imports `from kernels import ...` if fooled
assert hub_kernels.LayerRepository.__module__ == hub_kernels.__name__  # the stub, not ours
# probing must not import our heavy modules (triton kernels) behind the user's back
ours = [m for m in sys.modules if m.startswith("kernels.")]
assert not ours, ours

from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig
torch.manual_seed(0)
cfg = Qwen3_5TextConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=64,
)
model = Qwen3_5ForCausalLM(cfg).eval()
ids = torch.randint(0, cfg.vocab_size, (1, 7))
with torch.no_grad():
    ref = model(ids).logits
with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    loaded = AutoModelForCausalLM.from_pretrained(d).eval()
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM", type(loaded)
    with torch.no_grad():
        out = loaded(ids).logits
assert torch.equal(ref, out), (ref - out).abs().max()
assert not import_utils.is_kernels_available()
print("OK")
"""


def test_transformers_unaffected_by_our_kernels_package():
    env = dict(os.environ, BOLE_REPO=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=str(REPO))
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


def test_interpreting_reads_triton_interpret_as_triton_does(monkeypatch):
    from kernels._checks import interpreting

    for value, expected in (("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is expected, value
