#!/usr/bin/env python
"""Train bole-tiny-coder: a small Qwen3.5-architecture code model with one MTP layer.

Target: ``transformers.Qwen3_5ForCausalLM`` built from a ``Qwen3_5TextConfig`` (16 layers,
3 Gated DeltaNet : 1 gated full attention). Drafter: one MTP block trained jointly with the
target, laid out and named like the Qwen3.5 / Qwen3-Next checkpoints:

    mtp.pre_fc_norm_embedding.weight  [H]       zero-centred RMSNorm (1 + w), like the decoder's
    mtp.pre_fc_norm_hidden.weight     [H]
    mtp.fc.weight                     [H, 2H]   input = cat([norm_e(embed(x[t+1])), norm_h(h[t])])
    mtp.layers.0.*                              one full-attention Qwen3_5DecoderLayer
    mtp.norm.weight                   [H]
    (embed_tokens and lm_head are shared with the target)

``h[t]`` is the target's *final* hidden state at position t (after ``model.norm``, i.e. what
lm_head sees), the MTP block runs causally over positions with RoPE position t, and its output
through lm_head predicts x[t+2]. Loss = CE(target, x[t+1]) + lambda * CE(MTP, x[t+2]); the MTP
loss also trains the trunk (joint training).

Data: uint16 token streams from ``scripts/prepare_data.py`` (``.data/train.npz``,
``.data/heldout.npz``). Training stops at ``--steps`` or when the wall-clock budget runs out
(``--minutes`` for the loop, ``--deadline-s`` for the whole process), and always saves:

    <out>/config.json, generation_config.json, model.safetensors (target + mtp.*, bf16),
    training_log.json, loss_curve.png, README.md (model card)

Seeded (python / numpy / torch, batch offsets from a seeded generator). With ``--steps`` given
the run is reproducible up to GPU floating-point non-determinism; without it the cosine length is
fixed from the measured step time after ``--calib-steps`` steps and recorded in the log, so a
run can be repeated with ``--steps <that number>``.

GPU run: see scripts/run_gpu_train.sh. CPU smoke test (seconds): ``train_tiny.py --smoke``.
"""

from __future__ import annotations

import time

_T_PROCESS = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "bole-tiny-coder"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# --------------------------------------------------------------------------- model shapes

# Sized so that (a) one MTP layer (fc 2H*H + one attention layer) costs <= 1/16 of the 16 decoder
# layers, (b) ~20M parameters: model.safetensors ~44 MB in bf16, small enough that the checkpoint
# can live in the working tree and still travel to the GPU machine (64 MiB limit) later.
FULL = dict(
    hidden_size=256,
    num_hidden_layers=16,  # 4 x [3 GDN + 1 attention]
    intermediate_size=768,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

SMOKE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def make_config(shape: dict, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig

    s = dict(shape)
    rope_theta = s.pop("rope_theta")
    rotary_dim = int(s["head_dim"] * 0.25)
    half = rotary_dim // 2  # frequencies; text-only, so the 3 M-RoPE sections see equal positions
    third = -(-half // 3)
    mrope = [third, third, half - 2 * third]  # e.g. 8 -> [3, 3, 2] (Qwen3.5: 32 -> [11, 11, 10])
    n = s["num_hidden_layers"]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        attention_bias=False,
        attention_dropout=0.0,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        **s,
    )


class MTP(nn.Module):
    """One Qwen3.5 multi-token-prediction block (weights under ``mtp.``)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        # a full-attention decoder layer; layer_idx only matters for KV caches (unused here)
        attn_idx = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, attn_idx)])
        self.norm = Qwen3_5RMSNorm(H, eps=eps)
        std = config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, Qwen3_5RMSNorm):
                nn.init.zeros_(m.weight)

    def forward(self, next_embeds, hidden, position_embeddings):
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def rope(model, x, seq_len: int):
    """cos/sin for positions 0..seq_len-1 (text-only M-RoPE: 3 identical position rows)."""
    pos = torch.arange(seq_len, device=x.device).view(1, 1, -1).expand(3, x.shape[0], -1)
    return model.model.rotary_emb(x, pos)


def forward_losses(model, mtp, window, lam: float, need_acc: bool = False):
    """window: [B, T+2] tokens. Returns (loss, ce_target, ce_mtp, extras)."""
    inp, y1, y2 = window[:, :-2], window[:, 1:-1], window[:, 2:]
    out = model.model(input_ids=inp, use_cache=False)
    h = out.last_hidden_state  # after the final norm
    logits = model.lm_head(h)
    V = logits.shape[-1]
    ce1 = F.cross_entropy(logits.float().view(-1, V), y1.reshape(-1))
    pe = rope(model, h, h.shape[1])
    m = mtp(model.model.embed_tokens(y1), h, pe)
    mlogits = model.lm_head(m)
    ce2 = F.cross_entropy(mlogits.float().view(-1, V), y2.reshape(-1))
    extras = {}
    if need_acc:
        tgt_top = logits.argmax(-1)  # [B, T]   target greedy for position t+1
        mtp_top = mlogits.argmax(-1)  # [B, T]  draft for position t+2
        extras["target_correct"] = (tgt_top == y1).sum().item()
        extras["mtp_correct"] = (mtp_top == y2).sum().item()
        # draft for t+2 (made at t) vs the target's own greedy choice for t+2 (made at t+1)
        agree = mtp_top[:, :-1] == tgt_top[:, 1:]
        cond = tgt_top[:, :-1] == y1[:, :-1]  # target greedy would have produced x[t+1]
        extras["agree"] = agree.sum().item()
        extras["agree_n"] = agree.numel()
        extras["agree_cond"] = (agree & cond).sum().item()
        extras["cond_n"] = cond.sum().item()
        extras["n"] = y1.numel()
    return ce1 + lam * ce2, ce1, ce2, extras


def count_params(model, mtp, config) -> dict:
    emb = model.model.embed_tokens.weight.numel()
    head = 0 if config.tie_word_embeddings else model.lm_head.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    mtp_n = sum(p.numel() for p in mtp.parameters())
    return {
        "target_total": total,
        "target_embedding": emb,
        "target_lm_head": head,
        "target_decoder_layers": layers,
        "mtp_total": mtp_n,
        "total_with_mtp": total + mtp_n,
        "mtp_over_decoder_layers": round(mtp_n / layers, 4),
    }


# --------------------------------------------------------------------------- data


def load_tokens(path: Path) -> np.ndarray:
    with np.load(path) as z:
        return z["tokens"]


def smoke_tokens(tokenizer_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Tiny token streams for --smoke when .data/ is absent: this script and a stdlib module."""
    import textwrap as _tw

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    a = tok.encode(Path(__file__).read_text()).ids + [eos]
    b = tok.encode(Path(_tw.__file__).read_text()).ids + [eos]
    return np.asarray(a * 4, np.uint16), np.asarray(b, np.uint16)


class Batches:
    """Random windows of seq_len+2 tokens from a device-resident stream, seeded."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int, device):
        self.data = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.T, self.B = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.ar = torch.arange(seq_len + 2, device=device)
        assert len(tokens) > seq_len + 2, "not enough tokens"

    def next(self) -> torch.Tensor:
        off = torch.randint(0, len(self.data) - self.T - 2, (self.B,), generator=self.gen)
        return self.data[off.to(self.data.device)[:, None] + self.ar[None, :]]


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping held-out windows (stride seq_len, so every token is a target once)."""
    n = min(max_windows, (len(tokens) - 2) // seq_len)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 2)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, batch: int, lam: float, device, amp) -> dict:
    model.eval()
    mtp.eval()
    tot = {"ce1": 0.0, "ce2": 0.0, "tok": 0}
    acc = {}
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        with amp():
            _, ce1, ce2, ex = forward_losses(model, mtp, w, lam, need_acc=True)
        n = ex.pop("n")
        tot["ce1"] += ce1.item() * n
        tot["ce2"] += ce2.item() * n
        tot["tok"] += n
        for k, v in ex.items():
            acc[k] = acc.get(k, 0) + v
    model.train()
    mtp.train()
    t = max(1, tot["tok"])
    return {
        "heldout_tokens": tot["tok"],
        "heldout_loss_target": tot["ce1"] / t,
        "heldout_loss_mtp": tot["ce2"] / t,
        "heldout_ppl_target": math.exp(min(50.0, tot["ce1"] / t)),
        "target_top1_acc": acc.get("target_correct", 0) / t,
        "mtp_top1_acc": acc.get("mtp_correct", 0) / t,
        "mtp_agrees_with_target_greedy": acc.get("agree", 0) / max(1, acc.get("agree_n", 0)),
        "mtp_agrees_when_target_greedy_correct": acc.get("agree_cond", 0) / max(1, acc.get("cond_n", 0)),
    }


@torch.no_grad()
def greedy_acceptance(model, mtp, prompts: list[list[int]], new_tokens: int, eos_id: int, device, amp,
                      deadline: float) -> dict:
    """Exact depth-1 greedy MTP acceptance on the target's own greedy continuations.

    1. Greedy-decode ``new_tokens`` tokens per prompt with the target (batched, right-padded,
       no cache: everything is causal, so padding after a sequence's end never reaches it).
    2. Teacher-force prompt + continuation once more: at each generated position t+1 the draft
       MTP(h[t], y[t+1]) is accepted iff it equals the target's greedy token y[t+2].
    """
    model.eval()
    mtp.eval()
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)

    def padded(n: int) -> int:  # few distinct lengths: fewer kernel specialisations / autotunes
        return -(-n // 64) * 64

    L = padded(int(lens.max()) + new_tokens)
    seq = torch.full((B, L), eos_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = torch.tensor(p, device=device)
    cur = lens.clone()
    done_steps = 0
    for _ in range(new_tokens):
        if time.time() > deadline:
            break
        upto = padded(int(cur.max()))
        with amp():
            h = model.model(input_ids=seq[:, :upto], use_cache=False).last_hidden_state
            last = h[torch.arange(B, device=device), cur - 1]
            nxt = model.lm_head(last).argmax(-1)
        seq[torch.arange(B, device=device), cur] = nxt
        cur = cur + 1
        done_steps += 1
    accepted = total = 0
    if done_steps >= 3:
        upto = int(cur.max())
        with amp():
            h = model.model(input_ids=seq[:, :upto], use_cache=False).last_hidden_state
            pe = rope(model, h, upto - 1)
            m = mtp(model.model.embed_tokens(seq[:, 1:upto]), h[:, :-1], pe)
            draft = model.lm_head(m).argmax(-1)  # draft[:, t] is the guess for seq[:, t+2]
        for i in range(B):
            # drafts made once the prompt is consumed (y[t+1] generated), up to the first EOS
            gen = seq[i, int(lens[i]):int(cur[i])]
            eos_at = (gen == eos_id).nonzero()
            end = int(lens[i]) + (int(eos_at[0, 0]) + 1 if len(eos_at) else len(gen))
            t0, t1 = int(lens[i]) - 1, end - 2
            if t1 > t0:
                ok = draft[i, t0:t1] == seq[i, t0 + 2:t1 + 2]
                accepted += int(ok.sum())
                total += ok.numel()
    model.train()
    mtp.train()
    rate = accepted / max(1, total)
    return {"prompts": B, "new_tokens": done_steps, "drafts": total, "accepted": accepted,
            "acceptance_rate": rate, "tokens_per_target_step_depth1": 1.0 + rate,
            "sample_continuations": seq[:3, :].tolist(), "prompt_lens": lens[:3].tolist(),
            "cur_lens": cur[:3].tolist()}


# --------------------------------------------------------------------------- saving


def save_model(model, mtp, out: Path, tokenizer_dir: Path) -> dict:
    """save_pretrained (bf16 safetensors), then add the mtp.* tensors into model.safetensors."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        name.unlink()
    dtype = next(model.parameters()).dtype
    use_cache = model.config.use_cache
    model.config.use_cache = True
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="10GB")
    # keep training precision but with the shipped (bf16-rounded) values, so the evaluation
    # that follows measures exactly the saved weights
    model.to(dtype)
    mtp.to(torch.bfloat16).to(dtype)
    model.config.use_cache = use_cache
    path = out / "model.safetensors"
    sd = load_file(str(path))
    n_target = len(sd)
    for k, v in mtp.state_dict().items():
        sd[f"mtp.{k}"] = v.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(sd, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)
    if tokenizer_dir.resolve() != out.resolve():
        for fn in TOKENIZER_FILES:
            if (tokenizer_dir / fn).exists():
                shutil.copy(tokenizer_dir / fn, out / fn)
    return {"tensors_target": n_target, "tensors_mtp": len(sd) - n_target,
            "model_safetensors_bytes": path.stat().st_size}


def plot_curve(log: list[dict], evals: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is on the GPU machine, not necessarily on CPU boxes
        print(f"(no loss-curve PNG: {e})")
        return False
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(steps, [r["loss_target"] for r in log], label="train CE target (next token)")
    ax.plot(steps, [r["loss_mtp"] for r in log], label="train CE MTP (token t+2)")
    if evals:
        ax.scatter([e["step"] for e in evals], [e["heldout_loss_target"] for e in evals],
                   marker="o", color="C0", zorder=3, label="held-out target")
        ax.scatter([e["step"] for e in evals], [e["heldout_loss_mtp"] for e in evals],
                   marker="s", color="C1", zorder=3, label="held-out MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token, log scale)")
    ax.set_yscale("log")
    ax.set_title("bole-tiny-coder training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_card(out: Path, log: dict) -> None:
    """README.md model card from training_log.json."""
    c, d, p, r = log["config"], log.get("data", {}), log["params"], log.get("result", {})
    ev = r.get("final_eval", {})
    acc = r.get("greedy_acceptance", {})
    hw = log.get("hardware", {})

    def f(x, nd=4):
        return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    lines = [
        "---",
        "license: other",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [qwen3_5_text, gated-deltanet, mtp, code, tiny]",
        "---",
        "",
        "# bole-tiny-coder",
        "",
        "A tiny Python code model with the **Qwen3.5 text architecture** (Gated DeltaNet 3 : 1 gated",
        "full attention) and **one MTP drafter layer**, trained from scratch by the Bole project as the",
        "test / benchmark checkpoint for Bole's speculative decoding. It is a toy: expect",
        "plausible-looking Python, not correct programs.",
        "",
        "## Architecture",
        "",
        f"- `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`), {c['num_hidden_layers']} layers "
        "(`layer_types`: 3 × linear_attention then 1 × full_attention, repeated), "
        f"hidden {c['hidden_size']}, "
        f"FFN {c['intermediate_size']} (SwiGLU), vocab {c['vocab_size']}, "
        f"tie_word_embeddings {str(c['tie_word_embeddings']).lower()}.",
        f"- Gated DeltaNet: {c['linear_num_key_heads']} key / {c['linear_num_value_heads']} value heads, "
        f"dk = dv = {c['linear_key_head_dim']}, conv kernel {c['linear_conv_kernel_dim']}.",
        f"- Gated attention: {c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads, "
        f"head_dim {c['head_dim']}, partial RoPE 0.25 (theta {c['rope_parameters']['rope_theta']:g}).",
        f"- Parameters: target {p['target_total']:,} (decoder layers {p['target_decoder_layers']:,}, "
        f"embedding {p['target_embedding']:,}, lm_head {p['target_lm_head']:,}); "
        f"MTP {p['mtp_total']:,} = {100 * p['mtp_over_decoder_layers']:.2f} % of the decoder layers "
        f"(≤ 1/16 = 6.25 %).",
        "- MTP (`mtp_num_hidden_layers: 1`, shared embed_tokens and lm_head), tensors under `mtp.` in",
        "  `model.safetensors`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden` (zero-centred RMSNorm,",
        "  1 + w), `fc` [H, 2H] applied to `cat([norm(embed(x[t+1])), norm(h[t])])`, `layers.0.*` (one",
        "  full-attention decoder layer), `norm`. `h[t]` is the target's final hidden state *after*",
        "  `model.norm`; the MTP layer uses RoPE position t; lm_head(output) predicts x[t+2].",
        "- Weights are stored in bfloat16. transformers ignores the `mtp.*` tensors when loading",
        "  `AutoModelForCausalLM` (they are listed in `_keys_to_ignore_on_load_unexpected`).",
        "",
        "## Data",
        "",
        "Python source files found on the *data-preparation machine* (the Bole CPU build machine): the",
        "CPython standard library and the installed site-/dist-packages (torch, transformers, sympy,",
        "scipy, numpy, pip, ... — see `.data/meta.json` from `scripts/prepare_data.py`). Files were",
        "deduplicated by content hash; files under 200 B or over 256 KiB, auto-generated files and",
        "data-like files (long lines, little text) were skipped; the split into train / held-out is by",
        "file (seeded hash of the module path, so all installed copies of a module fall on the same",
        "side; ~2 % held out). The licences are those of the respective",
        "packages (mostly BSD / MIT / Apache / PSF); the model is for testing only.",
        "",
        f"- files kept: {d.get('file_stats', {}).get('kept', 'n/a')} "
        f"(train {d.get('train_files', 'n/a')}, held-out {d.get('heldout_files', 'n/a')})",
        f"- train tokens available: {d.get('train_tokens', 0):,}",
        f"- held-out tokens: {d.get('heldout_tokens', 0):,}; {d.get('bytes_per_token', 'n/a')} bytes/token "
        "(train text)",
        "- held-out prompt set: `benchmarks/data/heldout_prompts.jsonl` (function signatures + docstrings",
        "  from held-out files).",
        "",
        "Tokenizer: byte-level BPE trained with `tokenizers` (vocabulary 8192, specials",
        "`<|endoftext|>` (bos/eos), `<|im_start|>`, `<|im_end|>`, `<|pad|>`), ChatML chat template.",
        "",
        "## Training",
        "",
        f"- script: `scripts/train_tiny.py` ({' '.join(log.get('argv', []))}), seed {log['args']['seed']}",
        f"- hardware: {hw.get('device', 'n/a')}; torch {hw.get('torch', 'n/a')}, "
        f"transformers {hw.get('transformers', 'n/a')}, GDN kernels: {hw.get('gdn_kernels', 'n/a')}",
        f"- {r.get('steps', 'n/a')} steps × {log['args']['batch_size']} × {log['args']['seq_len']} tokens "
        f"= {r.get('tokens_seen', 0):,} tokens ({r.get('epochs', 0):.2f} epochs), "
        f"training time {r.get('train_seconds', 0) / 60:.1f} min "
        f"(process total {r.get('process_seconds', 0) / 60:.1f} min)",
        f"- AdamW (β 0.9/0.95, wd {log['args']['weight_decay']}), peak lr {log['args']['lr']}, "
        f"warmup {r.get('warmup_steps', log['args']['warmup'])} steps then cosine to "
        f"{log['args']['min_lr_frac']}× over {r.get('planned_steps', 'n/a')} planned steps, bf16 autocast, "
        f"loss = CE(next) + {log['args']['mtp_lambda']}·CE(MTP, t+2)",
        "",
        "## Results (held-out files)",
        "",
        f"Losses over {ev.get('heldout_tokens', 0):,} held-out tokens (non-overlapping windows of "
        f"{log['args']['seq_len']} tokens), with the saved bf16 weights.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| held-out loss, target (nats/token) | {f(ev.get('heldout_loss_target'))} |",
        f"| held-out loss, MTP (token t+2) | {f(ev.get('heldout_loss_mtp'))} |",
        f"| target top-1 accuracy | {f(ev.get('target_top1_acc'))} |",
        f"| MTP top-1 accuracy (t+2) | {f(ev.get('mtp_top1_acc'))} |",
        "| MTP agrees with target greedy (teacher-forced text) | "
        f"{f(ev.get('mtp_agrees_with_target_greedy'))} |",
        f"| **greedy depth-1 MTP acceptance** ({acc.get('prompts', 'n/a')} held-out prompts × "
        f"{acc.get('new_tokens', 'n/a')} tokens) | **{f(acc.get('acceptance_rate'))}** |",
        f"| tokens per target step, depth-1 draft | {f(acc.get('tokens_per_target_step_depth1'), 3)} |",
        "",
        "Acceptance is measured exactly for greedy decoding: the target's own greedy continuation of",
        "each prompt is generated, then every MTP draft MTP(h[t], y[t+1]) is compared with the target's",
        "greedy y[t+2].",
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'tok = AutoTokenizer.from_pretrained("models/bole-tiny-coder")',
        'model = AutoModelForCausalLM.from_pretrained("models/bole-tiny-coder")',
        'ids = tok("def fibonacci(n):\\n    \\"\\"\\"Return the n-th Fibonacci number.\\"\\"\\"\\n", '
        'return_tensors="pt").input_ids',
        "print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))",
        "```",
        "",
    ]
    samples = r.get("greedy_acceptance", {}).get("samples") or []
    if samples:
        lines += ["## Sample (greedy, held-out prompt)", "", "```python",
                  samples[0]["prompt"] + samples[0]["completion"], "```", ""]
    (out / "README.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------- main


def gdn_backend(use_fla: bool, device) -> str:
    """Decide the GDN kernels *before* transformers is imported (it resolves fla at import)."""
    if not use_fla or device.type != "cuda":
        sys.modules.setdefault("fla", None)  # make `import fla` fail -> transformers' torch path
        return "torch (transformers reference implementation)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        # the shapes the model uses (key heads repeated to the value heads, as transformers does)
        hk, hv, dk, dv = (FULL[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                             "linear_key_head_dim", "linear_value_head_dim"))
        kw = dict(device=device, dtype=torch.bfloat16)
        q = torch.randn(2, 256, hk, dk, **kw, requires_grad=True)
        k = torch.randn(2, 256, hk, dk, **kw, requires_grad=True)
        v = torch.randn(2, 256, hv, dv, **kw, requires_grad=True)
        g = -torch.rand(2, 256, hv, device=device, dtype=torch.float32)
        beta = torch.rand(2, 256, hv, **kw)
        rep = hv // hk
        o, _ = chunk_gated_delta_rule(q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v,
                                      g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()
        torch.cuda.synchronize()
        if not (torch.isfinite(o).all() and torch.isfinite(q.grad).all()):
            raise FloatingPointError("non-finite fla output")
        import fla

        return f"fla {getattr(fla, '__version__', '?')} (flash-linear-attention Triton kernels)"
    except Exception as e:  # noqa: BLE001 - any failure means: use the torch fallback
        print(f"WARNING: fla unavailable or failing ({type(e).__name__}: {e}); using the torch GDN path")
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
        sys.modules["fla"] = None
        return "torch (transformers reference implementation; fla failed)"


def parse_args(argv):
    ap = argparse.ArgumentParser(description="Train bole-tiny-coder (Qwen3.5 text + MTP).")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--data-dir", type=Path, default=REPO / ".data")
    ap.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "data" / "heldout_prompts.jsonl")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the training loop")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="budget of the whole process (from start): the loop stops --reserve-s before it")
    ap.add_argument("--reserve-s", type=float, default=75.0, help="time kept for eval + acceptance + save")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (reproducible schedule)")
    ap.add_argument("--calib-steps", type=int, default=40, help="steps timed to size the cosine schedule")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--mtp-lambda", type=float, default=0.3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (0: end only)")
    ap.add_argument("--eval-windows", type=int, default=960, help="held-out windows of seq_len (max)")
    ap.add_argument("--accept-prompts", type=int, default=200)
    ap.add_argument("--accept-new-tokens", type=int, default=128)
    ap.add_argument("--no-fla", action="store_true", help="force transformers' torch GDN path")
    ap.add_argument("--device", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, few steps, CPU-friendly (pipeline test; not a real model)")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in dict(steps=args.steps or 3, batch_size=2, seq_len=64, warmup=2, log_every=1,
                         eval_windows=4, accept_prompts=2, accept_new_tokens=4, calib_steps=0).items():
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    backend = gdn_backend(not args.no_fla, device)
    print(f"device {device}; GDN kernels: {backend}", flush=True)

    import transformers
    from transformers import Qwen3_5ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    # ---- data
    meta = {}
    if (args.data_dir / "meta.json").exists():
        meta = json.loads((args.data_dir / "meta.json").read_text())
    if (args.data_dir / "train.npz").exists():
        train_np = load_tokens(args.data_dir / "train.npz")
        held_np = load_tokens(args.data_dir / "heldout.npz")
        if args.smoke:  # keep the smoke test light
            train_np, held_np = train_np[:100_000], held_np[:20_000]
    elif args.smoke:
        train_np, held_np = smoke_tokens(args.tokenizer_dir)
    else:
        raise SystemExit(f"no {args.data_dir}/train.npz: run scripts/prepare_data.py first")
    tok_cfg = json.loads((args.tokenizer_dir / "tokenizer_config.json").read_text())
    tok_json = json.loads((args.tokenizer_dir / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
    vocab_size = len(tok_json["model"]["vocab"]) + len(
        [t for t in tok_json["added_tokens"] if t["content"] not in tok_json["model"]["vocab"]])
    eos_id, pad_id = vocab[tok_cfg["eos_token"]], vocab[tok_cfg["pad_token"]]
    print(f"tokens: train {len(train_np):,}, held-out {len(held_np):,}; vocab {vocab_size}", flush=True)

    # ---- model
    config = make_config(SMOKE if args.smoke else FULL, vocab_size, eos_id, pad_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(config)
    mtp = MTP(model.config)
    model.to(device)
    mtp.to(device)
    model.config.use_cache = False
    model.train()
    mtp.train()
    params = count_params(model, mtp, config)
    print("params:", json.dumps(params), flush=True)
    if not args.smoke:
        assert params["mtp_total"] * 16 <= params["target_decoder_layers"], "MTP must cost <= 1/16 of target"

    decay, no_decay = [], []
    for mod in (model, mtp):
        for n, p in mod.named_parameters():
            (decay if p.dim() >= 2 and "embed_tokens" not in n else no_decay).append(p)
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kwargs)

    def amp():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    batches = Batches(train_np, args.seq_len, args.batch_size, args.seed, device)
    held_windows = eval_windows(held_np, args.seq_len, args.eval_windows)

    total_steps = args.steps
    sched = {"warmup": args.warmup if total_steps is None else min(args.warmup, max(1, total_steps // 5))}

    def lr_at(step: int) -> float:
        wu = sched["warmup"]
        if step < wu:
            return args.lr * (step + 1) / wu
        n = total_steps if total_steps is not None else 10**9
        prog = min(1.0, (step - wu) / max(1, n - wu))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    stop = {"flag": False}

    def on_signal(signum, frame):  # stop cleanly (then save) on SIGTERM / SIGINT
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    t_loop = time.time()
    loop_deadline = t_loop + args.minutes * 60
    if args.deadline_s is not None:
        loop_deadline = min(loop_deadline, _T_PROCESS + args.deadline_s - args.reserve_s)
    log, evals = [], []
    step, tokens_seen = 0, 0
    t_calib0 = None
    error = None
    print(f"training: batch {args.batch_size} x {args.seq_len}, lr {args.lr}, budget "
          f"{(loop_deadline - t_loop) / 60:.2f} min", flush=True)
    try:
        while not stop["flag"]:
            if total_steps is not None and step >= total_steps:
                break
            if time.time() >= loop_deadline:
                print("wall-clock budget reached", flush=True)
                break
            lr = lr_at(step)
            for g in opt.param_groups:
                g["lr"] = lr
            w = batches.next()
            with amp():
                loss, ce1, ce2, _ = forward_losses(model, mtp, w, args.mtp_lambda)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()),
                                                   args.grad_clip)
            opt.step()
            step += 1
            tokens_seen += w.shape[0] * args.seq_len
            if total_steps is None and args.calib_steps > 0:
                if step == 10:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t_calib0 = time.time()
                elif step == 10 + args.calib_steps and t_calib0 is not None:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    per = (time.time() - t_calib0) / args.calib_steps
                    total_steps = step + int(0.98 * (loop_deadline - time.time()) / per)
                    total_steps = max(total_steps, step + 1)
                    if total_steps < 5 * sched["warmup"]:  # very slow run (e.g. no fla): shorter warmup
                        sched["warmup"] = max(step, total_steps // 5)
                    print(f"calibrated: {per * 1e3:.1f} ms/step -> total_steps {total_steps}", flush=True)
            if step % args.log_every == 0 or step == 1:
                rec = {"step": step, "tokens": tokens_seen, "elapsed_s": round(time.time() - t_loop, 2),
                       "lr": lr, "loss": loss.item(), "loss_target": ce1.item(), "loss_mtp": ce2.item(),
                       "grad_norm": float(gnorm)}
                if not all(math.isfinite(rec[k]) for k in ("loss", "loss_target", "loss_mtp")):
                    raise FloatingPointError(f"non-finite loss at step {step}: {rec}")
                log.append(rec)
                if step % (args.log_every * 10) == 0 or step == 1 or args.smoke:
                    print(json.dumps(rec), flush=True)
            if args.eval_every and step % args.eval_every == 0:
                e = evaluate(model, mtp, held_windows[:128], args.batch_size, args.mtp_lambda, device, amp)
                e["step"] = step
                evals.append(e)
                print("eval", json.dumps(e), flush=True)
    except Exception as e:  # noqa: BLE001 - always save what we have
        error = f"{type(e).__name__}: {e}"
        print(f"ERROR during training: {error}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t_loop

    # ---- save first, then measure
    saved = save_model(model, mtp, args.out, args.tokenizer_dir)
    print(f"saved {args.out}: {json.dumps(saved)}", flush=True)

    result = {"steps": step, "planned_steps": total_steps, "warmup_steps": sched["warmup"],
              "tokens_seen": tokens_seen,
              "epochs": tokens_seen / max(1, len(train_np)), "train_seconds": round(train_seconds, 1),
              "final_train_loss_target": log[-1]["loss_target"] if log else None,
              "final_train_loss_mtp": log[-1]["loss_mtp"] if log else None, "error": error,
              "saved": saved}
    final = evaluate(model, mtp, held_windows, args.batch_size, args.mtp_lambda, device, amp)
    final["step"] = step
    evals.append(final)
    result["final_eval"] = final
    print("final eval", json.dumps(final), flush=True)

    try:
        prompts = [json.loads(ln) for ln in args.prompts.read_text().splitlines() if ln.strip()]
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
        ids = [tk.encode(p["prompt"]).ids for p in prompts[: args.accept_prompts]]
        deadline = (_T_PROCESS + args.deadline_s - 15) if args.deadline_s else time.time() + 120
        acc = greedy_acceptance(model, mtp, ids, args.accept_new_tokens, eos_id, device, amp, deadline)
        samples = []
        rows = zip(acc.pop("sample_continuations"), acc.pop("prompt_lens"), acc.pop("cur_lens"), strict=True)
        for row, pl, cl in rows:
            samples.append({"prompt": tk.decode(row[:pl]), "completion": tk.decode(row[pl:cl])})
        acc["samples"] = samples
        result["greedy_acceptance"] = acc
        print("greedy acceptance", json.dumps({k: v for k, v in acc.items() if k != "samples"}), flush=True)
    except Exception as e:  # noqa: BLE001
        result["greedy_acceptance_error"] = f"{type(e).__name__}: {e}"
        print(f"acceptance measurement failed: {e}", flush=True)

    result["process_seconds"] = round(time.time() - _T_PROCESS, 1)
    cpu_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    hardware = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(), "gdn_kernels": backend}
    if device.type == "cuda":
        hardware["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    out_log = {
        "argv": sys.argv[1:],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "config": model.config.to_dict(), "params": params, "hardware": hardware, "data": meta,
        "result": result, "evals": evals, "log": log,
    }
    (args.out / "training_log.json").write_text(json.dumps(out_log, indent=1) + "\n")
    png = plot_curve(log, evals, args.out / "loss_curve.png")
    write_card(args.out, out_log)
    print(f"done in {time.time() - _T_PROCESS:.0f}s; loss curve: {png}; error: {error}", flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
