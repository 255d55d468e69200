"""`python -m bole generate` on a tiny checkpoint with a tokenizer, in every mode."""

import json
import os
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint, save_char_tokenizer, write_token_frequencies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_ckpt")
    make_checkpoint(path, "dense", vocab_size=40)
    save_char_tokenizer(path, 40)
    write_token_frequencies(path, 40)
    return str(path)


def test_cli_generate_all_modes_agree(model_dir):
    texts = {}
    # bole with --draft-vocab: the drafter scores 6 of the 40 ids (the folder's token_frequencies.json)
    # and with the paper's budget (--no-cap-tree-width, floor children) instead of the defaults
    for mode, extra in (("ar", []), ("serial_tree", []), ("bole", []), ("bole", ["--draft-vocab", "6"]),
                        ("bole", ["--no-cap-tree-width", "--budget-floor", "children"])):
        out = subprocess.run(
            [sys.executable, "-m", "bole", "generate", "--model", model_dir, "--prompt", "def add(a, b):",
             "--prompt", "x = ", "--mode", mode, "--max-tokens", "12", "--json", "--depth", "2", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
        assert len(lines) == 3 and lines[-1]["mode"] == mode and lines[-1]["tokens"] > 0
        texts[mode + "".join(extra)] = [x["token_ids"] for x in lines[:2]]
    assert texts["ar"] == texts["serial_tree"] == texts["bole"] == texts["bole--draft-vocab6"] \
        == texts["bole--no-cap-tree-width--budget-floorchildren"]


def test_cli_rejects_bad_arguments(model_dir):
    out = subprocess.run([sys.executable, "-m", "bole", "generate", "--model", model_dir, "--prompt", "x",
                          "--mode", "fast"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid choice" in out.stderr
