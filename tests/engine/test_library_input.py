"""``bole.LLM`` and the engine refuse bad input with a ValueError naming the value or the file, and a
failed ``generate()`` leaves nothing queued (issue 22, Deliver 7)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint, write_token_frequencies
from engine_helpers import default_table
from safetensors.torch import load_file, save_file

from bole import LLM, SamplingParams
from bole.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
OPTS = dict(mode="ar", device="cpu", num_blocks=32, block_size=4, max_num_seqs=4, calibration_table=default_table())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lib_input")
    make_checkpoint(path, "dense", vocab_size=16)
    return str(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **OPTS)


def copy_ckpt(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_float_ids_are_refused_integer_arrays_accepted(llm):
    with pytest.raises(ValueError, match=r"prompt 0: prompt token ids must be ints, got \[1.7\] \(float\)"):
        llm.generate([[1.7, 2]], GREEDY)
    with pytest.raises(ValueError, match="ints"):
        llm.generate([1, 2.0], GREEDY)
    with pytest.raises(ValueError, match="ints"):
        llm.generate([[True, 2]], GREEDY)
    want = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)]
    for batch in (np.array([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3], [4, 5, 6]]),
                  [np.array([1, 2, 3]), torch.tensor([4, 5, 6], dtype=torch.int32)],
                  [[np.int64(1), np.int32(2), 3], [torch.tensor(4), 5, 6]]):
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == want
    one = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids  # alone, not in a batch of two (ties can differ)
    assert llm.generate(np.array([1, 2, 3]), GREEDY)[0].token_ids == one   # 1-D: one prompt
    assert llm.generate(torch.tensor([1, 2, 3]), GREEDY)[0].token_ids == one
    for bad in (np.array([[1.0, 2.0]]), torch.tensor([1.5, 2.0]), np.array([True, False])):
        with pytest.raises(ValueError, match="must be integers, got an array of dtype"):
            llm.generate(bad, GREEDY)
    with pytest.raises(ValueError, match="1-D"):
        llm.generate(np.zeros((1, 2, 2), dtype=np.int64), GREEDY)


def test_generate_is_atomic(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match=r"prompt 2: prompt token ids out of range \[0, 16\): \[99\]"):
        llm.generate([[1, 2], [3, 4], [5, 99]], GREEDY)
    assert not eng.has_unfinished() and not eng.requests
    with pytest.raises(ValueError, match="prompt 1: params must be a SamplingParams"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, {"max_tokens": 3}])
    assert not eng.has_unfinished() and not eng.requests
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY])
    # the next call returns exactly its own outputs
    out = llm.generate([[1, 2]], GREEDY)
    assert len(out) == 1 and len(out[0].token_ids) == 3 and not eng.requests


def test_a_failing_step_leaves_nothing_queued(llm, monkeypatch):
    eng = llm.engine

    def broken_step():
        raise RuntimeError("step failed")
    monkeypatch.setattr(eng, "step", broken_step)  # a fault injected into the real engine's loop
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([[1, 2], [3, 4]], GREEDY)
    monkeypatch.undo()
    assert not eng.has_unfinished() and not eng.requests
    assert len(llm.generate([[1, 2]], GREEDY)) == 1


@pytest.mark.parametrize("option, value, message", [
    ("block_size", 2.5, r"CacheConfig.block_size must be an int, got 2.5 \(float\)"),
    ("num_blocks", "64", r"CacheConfig.num_blocks must be an int, got '64' \(str\)"),
    ("enable_prefix_cache", "no", r"CacheConfig.enable_prefix_cache must be a bool .*got 'no' \(str\)"),
    ("eos_token_ids", 5, r"eos_token_ids must be a list of ints, got 5 \(int\) \(one id: eos_token_ids=\[5\]\)"),
    ("eos_token_ids", [1, -2], r"eos_token_ids must be a list of non-negative ints"),
    ("max_num_seqs", 4.0, r"EngineConfig.max_num_seqs must be an int, got 4.0"),
    ("depth", True, r"SpecConfig.depth must be an int, got True"),
    ("mode", 3, r"EngineConfig.mode must be a string, got 3"),
])
def test_engine_options_are_type_checked(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**{option: value})
    assert EngineConfig.from_options(eos_token_ids=[np.int64(3)]).eos_token_ids == (3,)


@pytest.mark.parametrize("value", [True, False])
def test_removed_whole_step_graph_option_is_refused(ckpt, value):
    # the whole-step CUDA graph is gone (docs/performance-notes.md): its option says so, by name
    message = r"engine option 'cuda_graph_whole_step' was removed: .*measured no faster"
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(cuda_graph_whole_step=value)
    with pytest.raises(ValueError, match=message):
        LLM(ckpt, **OPTS, cuda_graph_whole_step=value)


def test_corrupt_safetensors_names_the_file(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "corrupt")
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:  # a garbled header
        f.seek(0)
        f.write(b"\xff" * 16)
    with pytest.raises(ValueError, match=f"{file}: not a readable safetensors file"):
        LLM(path, **OPTS)
    data = open(os.path.join(ckpt, "model.safetensors"), "rb").read()
    with open(file, "wb") as f:  # a truncated file: the header promises more data than there is
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=file):
        LLM(path, **OPTS)


def test_malformed_config_json_names_the_path(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "badcfg")
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    with open(cfg_file, "w") as f:
        f.write(json.dumps(cfg)[:-10])
    with pytest.raises(ValueError, match=f"{cfg_file}: not valid JSON"):
        LLM(path, **OPTS)
    with open(cfg_file, "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(ValueError, match=f"{cfg_file}: expected a JSON object"):
        LLM(path, **OPTS)
    with open(cfg_file, "w") as f:
        json.dump({**cfg, "num_hidden_layers": "four"}, f)
    with pytest.raises(ValueError, match=cfg_file):
        LLM(path, **OPTS)


def test_unreadable_calibration_table_and_tokenizer_name_the_file(ckpt, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=f"{missing}: cannot read this calibration table: No such file"):
        LLM(ckpt, **{**OPTS, "calibration_table": missing})
    broken = tmp_path / "broken.yaml"
    broken.write_text("buckets: [1, 2\n")
    with pytest.raises(ValueError, match=f"{broken}: cannot read this calibration table"):
        LLM(ckpt, **{**OPTS, "calibration_table": str(broken)})
    path = copy_ckpt(ckpt, tmp_path / "badtok")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{bad")
    with pytest.raises(ValueError, match=f"{path}: its tokenizer files could not be loaded"):
        LLM(path, **OPTS)


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_single_kind_layouts_are_refused_clearly(ckpt, tmp_path, kind):
    path = copy_ckpt(ckpt, tmp_path / kind)
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["layer_types"] = [kind] * cfg["num_hidden_layers"]
    json.dump(cfg, open(cfg_file, "w"))
    missing = "full_attention" if kind == "linear_attention" else r"linear_attention \(Gated DeltaNet\)"
    with pytest.raises(ValueError, match=f"{cfg_file}: layer_types has no {missing} layer .*hybrid models only"):
        LLM(path, **OPTS)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_tensor_and_file(ckpt, tmp_path, bad):
    path = copy_ckpt(ckpt, tmp_path / "nonfinite")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = bad
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"weight {name} \\({name} in {file}\\) has NaN / inf values"):
        LLM(path, **OPTS)


def test_fp16_overflow_is_named(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "overflow")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"][0] = 1e6   # finite in fp32, inf in float16
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight .* overflows torch.float16"):
        LLM(path, **{**OPTS, "dtype": "float16"})


def test_wide_tree_refusal_names_the_lookahead(ckpt):
    wide = LLM(ckpt, **{**OPTS, "mode": "bole", "num_blocks": 16, "depth": 4, "topk": 8, "beam": 8})
    with pytest.raises(ValueError, match=r"prompt 0: prompt \(2 tokens\) \+ max_tokens \(3\) \+ the tree lookahead "
                                         r"reserved per request \((\d+) tokens: 1 \+ \d+ draft nodes for depth 4, "
                                         r"topk 8, beam 8\) = \d+ does not fit the KV cache \(64 tokens\)"):
        wide.generate([[1, 2]], GREEDY)
    with pytest.raises(ValueError, match=r"does not fit the KV cache \(64 tokens = num_blocks 16 x block_size 4\)"):
        wide.generate([[1, 2]], SamplingParams(max_tokens=100))
    assert wide.engine.stats().held == 0


def test_engines_share_one_loaded_model(ckpt, tmp_path):
    """``LLM(path, model=...)``: engines built one after another on one loaded model (a benchmark's cells)
    emit what engines loading their own copy emit, each setting the drafter's options anew (a reduced draft
    vocabulary does not leak into the next engine); a model of another dtype is refused by name."""
    from bole.models.loader import load_model

    ckpt = copy_ckpt(ckpt, tmp_path / "shared")
    write_token_frequencies(ckpt, 16)
    model = load_model(ckpt, dtype="float32", device="cpu")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    spec = dict(OPTS, mode="bole", depth=3, topk=2, beam=2)
    own = [o.token_ids for o in LLM(ckpt, **spec).generate(prompts, GREEDY)]
    first = LLM(ckpt, model=model, **spec, draft_vocab=8)
    assert first.engine.model is model and model.mtp.vocab_ids.numel() == 8
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == own
    del first
    second = LLM(ckpt, model=model, **spec)
    assert model.mtp.vocab_ids is None
    assert [o.token_ids for o in second.generate(prompts, GREEDY)] == own
    with pytest.raises(ValueError, match="model: a loaded model is shared only at the options' dtype bfloat16"):
        LLM(ckpt, model=model, **dict(spec, dtype="bfloat16"))


# ---- config.json: the fields the shapes need, stated and agreeing with the weights

def edit_config(src: str, dst, edit) -> tuple[str, str]:
    """``src`` copied to ``dst`` with ``edit(config dict)`` applied to its config.json; (folder, config.json)."""
    path = copy_ckpt(src, dst)
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    edit(cfg)
    json.dump(cfg, open(cfg_file, "w"))
    return path, cfg_file


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "head_dim",
                                   "num_key_value_heads", "linear_num_value_heads", "linear_conv_kernel_dim",
                                   "intermediate_size"])
def test_config_without_a_shape_field_is_refused(ckpt, tmp_path, field):
    # transformers would fill in its class default (a 9B shape): vocab_size then failed as a shape mismatch naming
    # no field, linear_conv_kernel_dim (default 4 = the weights') loaded on a config that does not say it
    path, cfg_file = edit_config(ckpt, tmp_path / field, lambda c: c.pop(field))
    with pytest.raises(ValueError, match=f"^{cfg_file}: {field} is missing; the checkpoint's tensor shapes"):
        LLM(path, **OPTS)


def test_config_without_layer_types_needs_the_interval(ckpt, tmp_path):
    def drop(c):
        c.pop("layer_types")
    path, cfg_file = edit_config(ckpt, tmp_path / "no_types", drop)
    with pytest.raises(ValueError, match=f"{cfg_file}: layer_types is missing \\(and no full_attention_interval\\)"):
        LLM(path, **OPTS)
    # Qwen3-Next's released configs give full_attention_interval instead of layer_types: that loads
    def interval(c):
        c.pop("layer_types")
        c["full_attention_interval"] = 4
    path, _ = edit_config(ckpt, tmp_path / "interval", interval)
    want = LLM(ckpt, **OPTS).generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert LLM(path, **OPTS).generate([[1, 2, 3]], GREEDY)[0].token_ids == want


def test_multimodal_config_needs_its_text_config_fields(ckpt, tmp_path):
    def wrap(drop):
        def edit(c):
            text = dict(c)
            text.pop(drop, None)
            c.clear()
            c.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"])
            if drop != "text_config":
                c["text_config"] = text
        return edit
    path, _ = edit_config(ckpt, tmp_path / "mm", wrap(None))
    assert LLM(path, **OPTS).engine.model.config.vocab_size == 16   # the multimodal layout loads
    path, cfg_file = edit_config(ckpt, tmp_path / "mm_vocab", wrap("vocab_size"))
    with pytest.raises(ValueError, match=f"{cfg_file}: text_config.vocab_size is missing"):
        LLM(path, **OPTS)
    path, cfg_file = edit_config(ckpt, tmp_path / "mm_flat", wrap("text_config"))
    with pytest.raises(ValueError, match=f"{cfg_file}: model_type 'qwen3_5' keeps the text model's fields in a "
                                         "'text_config' object, and there is none"):
        LLM(path, **OPTS)


@pytest.mark.parametrize("field, value, implied", [
    ("vocab_size", 32, 16), ("hidden_size", 32, 64), ("num_hidden_layers", 3, "model.layers.3"),
    ("head_dim", 8, 16), ("num_attention_heads", 2, 4), ("num_key_value_heads", 1, 2),
    ("linear_num_value_heads", 2, 4), ("linear_value_head_dim", 16, 8), ("linear_conv_kernel_dim", 3, 4),
    ("linear_key_head_dim", 8, 32), ("intermediate_size", 64, 96), ("layer_types", "swap", "linear_attention"),
    ("tie_word_embeddings", "no_head", "lm_head.weight"),
])
def test_config_disagreeing_with_the_weights_names_the_field(ckpt, tmp_path, field, value, implied):
    def edit(c):
        if field == "num_hidden_layers":
            c["layer_types"] = c["layer_types"][1:]   # 3 layers, still hybrid
        if value == "swap":
            c["layer_types"] = c["layer_types"][::-1]
        elif value != "no_head":
            c[field] = value
    path, cfg_file = edit_config(ckpt, tmp_path / field, edit)
    if value == "no_head":
        tensors = load_file(os.path.join(path, "model.safetensors"))
        del tensors["lm_head.weight"]
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    shown = "linear_num_key_heads \\* linear_key_head_dim" if field == "linear_key_head_dim" else field
    with pytest.raises(ValueError, match=f"^{cfg_file}: {shown}.*(disagrees with the weights|no lm_head)") as e:
        LLM(path, **OPTS)
    assert str(implied) in str(e.value)


def test_moe_config_fields(tmp_path):
    src = tmp_path / "moe"
    make_checkpoint(src, "moe", vocab_size=16)
    path, cfg_file = edit_config(str(src), tmp_path / "no_topk", lambda c: c.pop("num_experts_per_tok"))
    with pytest.raises(ValueError, match=f"{cfg_file}: num_experts_per_tok is missing"):
        LLM(path, **OPTS)
    for field, value, implied in (("num_experts", 4, 8), ("moe_intermediate_size", 16, 32),
                                  ("shared_expert_intermediate_size", 24, 48)):
        path, cfg_file = edit_config(str(src), tmp_path / field, lambda c, f=field, v=value: c.update({f: v}))
        with pytest.raises(ValueError, match=f"^{cfg_file}: {field}={value} disagrees with the weights: .*"
                                             f"which means {field}={implied}"):
            LLM(path, **OPTS)
    assert LLM(str(src), **OPTS).engine.model.config.num_experts == 8


# ---- SamplingParams.n: n choices per prompt, as the HTTP layer's

@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_n_is_validated_by_name(bad):
    with pytest.raises(ValueError, match=f"n must be an int >= 1, got {bad!r}") as e:
        SamplingParams(n=bad)
    assert e.value.param == "n"


def test_greedy_n_choices_are_identical(llm):
    one = llm.generate([[1, 2, 3], [4, 5]], GREEDY)
    two = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    assert len(two) == 2 and not llm.engine.requests
    for a, b in zip(one, two):
        assert [c.index for c in b.outputs] == [0, 1] and len({c.request_id for c in b.outputs}) == 2
        assert [c.token_ids for c in b.outputs] == [a.token_ids] * 2 and b.token_ids == a.token_ids
    assert [c.token_ids for c in one[0].outputs] == [one[0].token_ids]   # n=1: outputs holds the one choice


def test_seeded_n_choices_are_the_http_layers(llm):
    """Choice j of a seeded request samples with seed + j, exactly the requests deployments/choices.py makes."""
    from types import SimpleNamespace

    from deployments.choices import make_choices
    from deployments.openai_protocol import CompletionRequest

    prompt = [1, 2, 3]
    req = CompletionRequest(model="m", prompt=prompt, n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    http = make_choices(SimpleNamespace(max_choices=8, max_model_len=64), req, [prompt], 6, "cmpl", None)
    assert [c.params.seed for c in http] == [7, 8, 9]
    want = [o.token_ids for o in llm.generate([prompt] * 3, [c.params for c in http])]
    got = llm.generate([prompt], SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in got[0].outputs] == want and len(set(map(tuple, want))) > 1
    with pytest.raises(ValueError, match=r"prompt 1: n=2 choices take seeds .*seed must be an int in"):
        llm.generate([prompt, prompt], [GREEDY, SamplingParams(n=2, seed=2**63 - 1)])
    assert not llm.engine.requests


def test_the_engine_refuses_n_it_would_serve_once(llm):
    """An engine request is one sequence: n > 1 sent to the engine itself (not through LLM.generate or the
    endpoint, which expand it) is refused by name, not served once."""
    with pytest.raises(ValueError, match="n=2: an engine request is one sequence") as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert e.value.param == "n" and not llm.engine.requests


# ---- draft_vocab within the vocabulary

def test_draft_vocab_larger_than_the_vocabulary_is_refused_before_loading(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "dv")
    write_token_frequencies(path, 16)
    spec = dict(OPTS, mode="bole", depth=2, topk=2, beam=2)
    assert LLM(path, **spec, draft_vocab=16).engine.model.mtp.vocab_ids.numel() == 16   # the whole vocabulary
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)   # refused before the (now unreadable) weights are opened
    with pytest.raises(ValueError, match=r"draft_vocab=17 is larger than the model's vocabulary \(vocab_size=16\)"):
        LLM(path, **spec, draft_vocab=17)
