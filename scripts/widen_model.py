#!/usr/bin/env python
"""Widen a Qwen3.5 hybrid checkpoint to a larger text shape computing the same function
(``bole.models.widen``): a "<shape>-cost, embedded model's predictions" checkpoint for timing runs.

    python scripts/widen_model.py --model models/bole-tiny-coder --shape qwen3.5-9b --out /tmp/w9b

Shapes are ``bole.calibrate_sweep.SHAPES``, vocabulary included (248,320 rows): the rows past the
source's copy real rows minus alpha times a positive constant channel, so they never win (the module
docstring). The tokenizer and generation files are copied, so the widened folder serves like the source.
"""

from __future__ import annotations

import argparse

from bole.calibrate_sweep import SHAPES, shapes_config
from bole.models.widen import copy_tokenizer_files, widen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="source checkpoint folder (config.json + safetensors)")
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES), help="target text shape")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dtype", default="auto", help="dtype of the written tensors (auto: the source's)")
    args = ap.parse_args(argv)
    report = widen(args.model, args.out, shapes_config(args.shape), dtype=args.dtype)
    copy_tokenizer_files(args.model, args.out)
    cfg = report.config
    exact = "every norm exact" if not any(report.eps_bounds.values()) else f"eps bounds {report.eps_bounds}"
    print(f"{args.out}: {args.shape} shapes (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}: padded rows -{report.alpha:g} at constant channel {report.channel}, c = "
          f"{report.constant:.4g}), {report.copies} hidden copies, eps {report.eps:g}, {exact}")


if __name__ == "__main__":
    main()
