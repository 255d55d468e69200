"""Tiny random Hugging Face checkpoints for engine tests, written by transformers' own classes.

``make_checkpoint(path, kind, vocab_size)`` saves a 4-layer (3 GDN + 1 gated attention) model with
``save_pretrained`` and adds random ``mtp.*`` tensors (one MTP decoder layer) to its safetensors.
A small vocabulary makes random drafts get accepted often, so speculative paths are exercised.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, initializer_range=0.1, rms_norm_eps=1e-6)


def hf_classes(kind: str):
    if kind == "dense":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer, dict(intermediate_size=96)
    if kind == "moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer, dict(
            moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    raise ValueError(f"unknown checkpoint kind {kind!r}")


def make_checkpoint(path, kind: str = "dense", vocab_size: int = 16, seed: int = 0, mtp_scale: float = 0.1,
                    **overrides):
    """Write the checkpoint to ``path``; returns the transformers model (eval mode, fp32).

    ``overrides`` replace ``BASE`` shapes (e.g. ``num_key_value_heads=1``)."""
    Config, Model, Layer, extra = hf_classes(kind)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = Config(vocab_size=vocab_size, **{**BASE, **extra, **overrides})
    hf = Model(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    layer = Layer(cfg, cfg.layer_types.index("full_attention")).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(mtp_scale * torch.randn(p.shape, generator=gen) if p.dim() >= 2 else
                    p + 0.2 * torch.randn(p.shape, generator=gen))
    H = cfg.hidden_size
    tensors = load_file(f"{path}/model.safetensors")
    tensors.update({f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()})
    tensors["mtp.fc.weight"] = mtp_scale * torch.randn(H, 2 * H, generator=gen)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{n}.weight"] = 0.2 * torch.randn(H, generator=gen)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return hf


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_char_tokenizer(path, vocab_size: int) -> None:
    """A character-level Hugging Face tokenizer with exactly ``vocab_size`` ids and a chat template.

    Ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|>; the rest are printable characters (unknown
    characters map to the last id). Lets CLI / server tests use text with a tiny-vocabulary model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list(" etaoinshrdlucmfwypvbgkqjxz\n.,:;()=_0123456789ETAOINSHRDLUCMFWYPVBGKQJXZ'\"!?+-*/<>[]{}#")
    n = vocab_size - len(specials)
    if n < 2:
        raise ValueError(f"vocab_size {vocab_size} is too small for a character tokenizer")
    vocab = {t: i for i, t in enumerate(specials + chars[: n - 1] + ["\ufffd"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="\ufffd"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="\ufffd")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_token_frequencies(path, vocab_size: int, seed: int = 0) -> list[int]:
    """A ``token_frequencies.json`` in ``path`` ranking the ids in a seeded random order (so a reduced
    draft vocabulary is not simply the lowest ids); returns that order."""
    import json

    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()
    counts = list(range(vocab_size, 0, -1))
    with open(f"{path}/token_frequencies.json", "w") as fh:
        json.dump({"token_ids": order, "counts": counts, "total_tokens": sum(counts),
                   "source": {"script": "tests/checkpoints.py"}}, fh)
    return order
