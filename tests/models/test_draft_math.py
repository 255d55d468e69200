"""The drafter's tensor-core context (bole/layers/draft_math.py) and where the engine applies it.

Drafts only propose, so the drafter may round as it likes; what must hold is that the context is
scoped (the target's products stay exact fp32 outside it, also after an exception), that SDPA inside
it runs in bf16 only for fp32 CUDA inputs, and that the engine's option reaches the drafter. Output
exactness with the option on is the engines' greedy tests (every mode against ar, CPU and GPU).
"""

import pytest
import torch
from checkpoints import make_checkpoint
from engine_helpers import default_table

from bole.config import EngineConfig, SpecConfig
from bole.engine.engine import LLMEngine
from bole.layers.attention import sdpa
from bole.layers.draft_math import bf16_attention, draft_math
from bole.models.loader import load_model


def test_context_is_scoped_and_restores_after_errors():
    before = torch.get_float32_matmul_precision()
    with draft_math(False):
        assert not bf16_attention() and torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError):
        with draft_math(True):
            assert bf16_attention() and torch.get_float32_matmul_precision() == "high"
            raise RuntimeError("boom")
    assert not bf16_attention() and torch.get_float32_matmul_precision() == before


def test_new_precision_api_is_left_alone():
    # a process that sets TF32 through torch's per-backend API: the legacy getter would raise on the
    # mix, so the drafter keeps that setting and only switches its attention
    m = torch.backends.cuda.matmul
    before = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        with draft_math(True):
            assert bf16_attention() and m.fp32_precision == "tf32"
        assert not bf16_attention() and m.fp32_precision == "tf32"
    finally:
        m.fp32_precision = before
        torch.set_float32_matmul_precision("highest")


def test_sdpa_on_cpu_is_untouched_inside_the_context():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    mask = torch.rand(5, 5, generator=gen) > 0.3
    mask[:, 0] = True
    ref = sdpa(q, k, v, mask, 8 ** -0.5)
    with draft_math(True):
        assert torch.equal(sdpa(q, k, v, mask, 8 ** -0.5), ref)


@pytest.mark.gpu
def test_sdpa_in_bf16_inside_the_context_on_cuda():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 64, generator=gen).cuda() for _ in range(3))
    mask = (torch.rand(9, 40, generator=gen) > 0.3).cuda()
    mask[:, 0] = True
    k, v = (torch.randn(2, 4, 40, 64, generator=gen).cuda() for _ in range(2))
    ref = sdpa(q.double(), k.double(), v.double(), mask, 0.125)
    exact = sdpa(q, k, v, mask, 0.125)
    with draft_math(True):
        fast = sdpa(q, k, v, mask, 0.125)
    assert fast.dtype == torch.float32
    assert (exact.double() - ref).abs().max() < 1e-5          # outside: fp32
    assert 1e-5 < (fast.double() - ref).abs().max() < 3e-2      # inside: bf16 rounding, no worse


def test_engine_option_reaches_the_drafter(tmp_path):
    make_checkpoint(tmp_path, "dense", 16)
    for on in (True, False):
        cfg = EngineConfig.from_options(mode="bole", calibration_table=default_table(), num_blocks=32, block_size=4,
                                        depth=2, topk=2, beam=2, max_num_seqs=2, draft_fast_math=on)
        assert LLMEngine(load_model(str(tmp_path), dtype="float32"), cfg).model.mtp.fast_math is on


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bad_option_raises(bad):
    with pytest.raises(ValueError, match="draft_fast_math"):
        SpecConfig(draft_fast_math=bad)
