"""A tiny servable model folder: a random 4-layer checkpoint (tests/checkpoints.py) plus a small
byte-level BPE tokenizer with a ChatML chat template, vocabulary sizes matched."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoints import make_checkpoint  # noqa: E402

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' "
                 "+ message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
          "for i in range(10):\n    print(i)\n",
          "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
          "Hello world! The quick brown fox jumps over the lazy dog."] * 20


def make_tiny_model(path, vocab_size: int = 300, seed: int = 0) -> str:
    """Write tokenizer + checkpoint into ``path`` (vocab = the tokenizer's size); returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
                                   pad_token=SPECIALS[3], additional_special_tokens=SPECIALS[1:3])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    make_checkpoint(path, "dense", vocab_size=len(fast), seed=seed)
    fast.save_pretrained(path)
    return str(path)
