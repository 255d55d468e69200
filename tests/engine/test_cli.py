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


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bole", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["no_folder", "bad_config", "max_tokens", "depth", "memory", "draft_vocab"])
def test_cli_bad_input_is_one_error_line_and_status_2(model_dir, tmp_path, case):
    """A user's mistake prints `error: <message>` (one line, no traceback) and exits 2, argparse's status; each
    case here fails before the model's weights load."""
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"model_type": "qwen3_5_text", "vocab_size": ')
    model, extra, message = {
        "no_folder": (str(tmp_path / "nope"), [], f"{tmp_path / 'nope'}: no such model folder"),
        "bad_config": (str(bad_config), [], f"{bad_config / 'config.json'}: not valid JSON"),
        "max_tokens": (model_dir, ["--max-tokens", "0"], "max_tokens must be an int >= 1"),
        "depth": (model_dir, ["--depth", "0"], "SpecConfig.depth must be an int >= 1, got 0"),
        "memory": (model_dir, ["--gpu-memory-utilization", "2"], "CacheConfig.gpu_memory_utilization must be a float"),
        "draft_vocab": (model_dir, ["--draft-vocab", "41"], "draft_vocab=41 is larger than the model's vocabulary "
                                                            "(vocab_size=40)"),
    }[case]
    out = run_cli("--model", model, "--prompt", "x", "--device", "cpu", *extra)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {message}") and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_cli_internal_error_keeps_its_traceback(model_dir, monkeypatch):
    """Only a user's mistake becomes an error line: a bug (here a fault injected into generation) propagates."""
    import bole
    from bole.__main__ import main

    class Broken(bole.LLM):
        def generate(self, *args, **kwargs):
            raise RuntimeError("a bug")
    monkeypatch.setattr(bole, "LLM", Broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--model", model_dir, "--prompt", "x", "--device", "cpu", "--mode", "ar"])
