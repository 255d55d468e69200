"""`python -m bole generate` on a tiny checkpoint with a tokenizer, in every mode."""

import json
import os
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint, save_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_ckpt")
    make_checkpoint(path, "dense", vocab_size=40)
    save_char_tokenizer(path, 40)
    return str(path)


def test_cli_generate_all_modes_agree(model_dir):
    texts = {}
    for mode in ("ar", "serial_tree", "bole"):
        out = subprocess.run(
            [sys.executable, "-m", "bole", "generate", "--model", model_dir, "--prompt", "def add(a, b):",
             "--prompt", "x = ", "--mode", mode, "--max-tokens", "12", "--json", "--depth", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
        assert len(lines) == 3 and lines[-1]["mode"] == mode and lines[-1]["tokens"] > 0
        texts[mode] = [x["token_ids"] for x in lines[:2]]
    assert texts["ar"] == texts["serial_tree"] == texts["bole"]


def test_cli_rejects_bad_arguments(model_dir):
    out = subprocess.run([sys.executable, "-m", "bole", "generate", "--model", model_dir, "--prompt", "x",
                          "--mode", "fast"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid choice" in out.stderr
