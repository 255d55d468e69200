"""Loader: sharded / multimodal layouts, dtype, errors with names, tensor-parallel slicing."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bole.config import ModelConfig
from bole.models.loader import CheckpointReader, checkpoint_files, load_model, read_config, tp_slice


def _copy(ck, dst, edit=None):
    shutil.copytree(ck.path, dst)
    if edit is not None:
        f = os.path.join(dst, "model.safetensors")
        tensors = load_file(f)
        edit(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    return str(dst)


def _params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def dense(checkpoints):
    ck = checkpoints("dense")
    return ck, _params(load_model(ck.path, dtype="float32", backend="torch"))


def _shard(ck, out, first: str, second: str) -> tuple[dict, list]:
    """``ck``'s checkpoint copied to ``out`` as two shards (names sorted, split in half) with the index;
    its tensors and sorted names."""
    tensors = load_file(os.path.join(ck.path, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shutil.copytree(ck.path, out)
    os.remove(out / "model.safetensors")
    shards = {first: names[:half], second: names[half:]}
    for fname, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(out / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors, names


def test_sharded_with_index(dense, tmp_path):
    ck, ref = dense
    out = tmp_path / "sharded"
    _shard(ck, out, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    got = _params(load_model(str(out), dtype="float32", backend="torch"))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def test_multimodal_prefix_and_vision_tower_skipped(dense, tmp_path):
    ck, ref = dense
    from transformers import Qwen3_5Config

    out = tmp_path / "mm"
    def edit(t):
        for n in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + n[len("model."):]] = t.pop(n)
        t["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    _copy(ck, out, edit)
    text = ck.hf_config.to_dict()
    cfg = Qwen3_5Config(text_config=text)
    cfg.save_pretrained(out)
    hf_cfg, mc = read_config(str(out))
    assert hf_cfg.model_type == "qwen3_5" and mc.model_type == "qwen3_5_text"
    got = _params(load_model(str(out), dtype="float32", backend="torch"))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def test_checkpoint_reader_reads_shards_by_name_and_closes(dense, tmp_path):
    ck, _ = dense
    dst = tmp_path / "sharded"
    tensors, names = _shard(ck, dst, "a.safetensors", "b.safetensors")
    with CheckpointReader(checkpoint_files(str(dst))) as reader:
        for n in (names[0], names[-1], names[0]):
            assert torch.equal(reader.get(n), tensors[n])
        assert len(reader._handles) == 2   # each shard opened once
    assert not reader._handles


def test_dtype_choice(dense):
    ck, _ = dense
    m = load_model(ck.path, dtype=torch.bfloat16, backend="torch")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(ck.path, backend="torch").parameters()} == {torch.float32}  # "auto"
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(ck.path, dtype="int7", backend="torch")


def test_missing_and_unexpected_tensors_are_listed(dense, tmp_path):
    ck, _ = dense
    def edit(t):
        del t["model.layers.1.linear_attn.A_log"]
        del t["mtp.layers.0.self_attn.k_norm.weight"]
        t["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
    path = _copy(ck, tmp_path / "bad", edit)
    with pytest.raises(ValueError) as e:
        load_model(path, dtype="float32", backend="torch")
    msg = str(e.value)
    assert "missing tensors (2)" in msg and "model.layers.1.linear_attn.A_log" in msg
    assert "mtp.layers.0.self_attn.k_norm.weight" in msg
    assert "unexpected tensors (1)" in msg and "model.layers.0.mlp.bogus.weight" in msg


def test_missing_expert_is_listed(checkpoints, tmp_path):
    ck = checkpoints("moe")
    path = _copy(ck, tmp_path / "bad_moe", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path, dtype="float32", backend="torch")


def test_shape_mismatch(dense, tmp_path):
    ck, _ = dense
    name = "model.layers.3.self_attn.k_proj.weight"
    path = _copy(ck, tmp_path / "shape", lambda t: t.update({name: torch.zeros(8, 64)}))
    with pytest.raises(ValueError, match=re.escape(name) + r".*\(8, 64\).*\(32, 64\)"):
        load_model(path, dtype="float32", backend="torch")


def test_unsupported_model_type_and_no_pickles(dense, tmp_path):
    ck, _ = dense
    path = _copy(ck, tmp_path / "llama")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_model(path)
    pk = tmp_path / "pickled"
    pk.mkdir()
    shutil.copy(os.path.join(ck.path, "config.json"), pk / "config.json")
    (pk / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        load_model(str(pk))


def _merge(name, slices, cfg: ModelConfig, full_shape):
    """Inverse of the TP plan, written independently: how the full tensor is laid out."""
    if slices[0].shape == full_shape:  # replicated: every rank holds the same tensor
        assert all(torch.equal(s, slices[0]) for s in slices), name
        return slices[0]
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        kd, vd = cfg.linear_key_dim // len(slices), cfg.linear_value_dim // len(slices)
        parts = [s.split([kd, kd, vd]) for s in slices]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    if name.endswith("experts.gate_up_proj"):
        halves = [s.chunk(2, dim=1) for s in slices]
        return torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1)
    if name.endswith("experts.down_proj"):
        return torch.cat(slices, 2)
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        return torch.cat(slices, 1)
    return torch.cat(slices, 0)


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_tp_slices_concatenate_to_full_tensors(checkpoints, kind):
    ck = checkpoints(kind)
    full = load_model(ck.path, dtype="float32", backend="torch")
    ranks = [load_model(ck.path, dtype="float32", backend="torch", tp_rank=r, tp_size=2) for r in range(2)]
    cfg = full.config
    fp = _params(full)
    rp = [_params(m) for m in ranks]
    sharded = 0
    for name, t in fp.items():
        slices = [p[name] for p in rp]
        if slices[0].shape != t.shape:
            sharded += 1
        assert torch.equal(_merge(name, slices, cfg, t.shape), t), name
    assert sharded > 10
    assert ranks[0].model.layers[3].self_attn.num_heads == 2
    assert ranks[1].model.layers[0].linear_attn.num_v_heads == 2


def test_tp_indivisible_raises(dense):
    ck, _ = dense
    with pytest.raises(ValueError, match="tp_size=3"):  # 4 / 2 heads: neither split nor replicated
        load_model(ck.path, dtype="float32", backend="torch", tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank"):
        load_model(ck.path, tp_rank=2, tp_size=2)


def test_tp4_replicates_kv_and_gdn_key_heads(dense):
    """2 KV heads / 2 GDN key heads over 4 ranks: rank r holds head r // 2 of each (vLLM-style)."""
    ck, _ = dense
    full = load_model(ck.path, dtype="float32", backend="torch")
    m = load_model(ck.path, dtype="float32", backend="torch", tp_rank=3, tp_size=4)
    attn, gdn = m.model.layers[3].self_attn, m.model.layers[0].linear_attn
    assert (attn.num_heads, attn.num_kv_heads, gdn.num_k_heads, gdn.num_v_heads) == (1, 1, 1, 1)
    D = full.config.head_dim
    k_full = full.model.layers[3].self_attn.k_proj.weight
    assert torch.equal(attn.k_proj.weight, k_full[D:2 * D])
    kd, dk = full.config.linear_key_dim, full.config.linear_key_head_dim
    qkv = full.model.layers[0].linear_attn.in_proj_qkv.weight
    assert torch.equal(gdn.in_proj_qkv.weight[dk:2 * dk], qkv[kd + dk:kd + 2 * dk])  # k head 1
    assert m.local_config.conv_dim == gdn.conv_dim


def test_tp_slice_replicates_norms(dense):
    ck, _ = dense
    _, cfg = read_config(ck.path)
    w = torch.randn(64)
    assert tp_slice("model.layers.0.input_layernorm.weight", w, cfg, 1, 2) is w


def test_fusing_frees_the_original_projections(checkpoints, monkeypatch):
    """load_model fuses each group of projections (bole.layers.linear) with nothing of its own still holding
    the originals: otherwise every fused weight exists twice for a moment, and a 27B-shape checkpoint (55 GB)
    overflowed an 80 GB GPU while loading. Checked by weak references: right after a group is fused (before
    the next one is) its original weights must already be freed."""
    import gc
    import weakref

    from bole.layers import linear

    real_init, alive = linear.FusedLinear.__init__, []

    def init(self, linears):
        refs = [weakref.ref(lin.weight) for lin in linears]
        real_init(self, linears)
        gc.collect()
        alive.append(sum(r() is not None for r in refs))

    monkeypatch.setattr(linear.FusedLinear, "__init__", init)
    for kind in ("dense", "moe"):
        alive.clear()
        load_model(checkpoints(kind).path, dtype="float32", backend="torch")
        assert alive and not any(alive), f"{kind}: originals still held after fusing: {alive}"
