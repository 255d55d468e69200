#!/usr/bin/env python
"""Token frequencies of the training data, for the drafter's reduced vocabulary (``SpecConfig.draft_vocab``).

Re-collects the files of ``scripts/prepare_data.py`` (same roots, filters, seed and split, through its
own functions), tokenizes the first ``--max-tokens`` of the TRAIN stream in its seeded order (the
prefix of the stream the model was trained on: file, ``<|endoftext|>``, file, ...) with the model's
tokenizer, and writes ``token_frequencies.json`` into the model folder:

    token_ids      every id of the vocabulary, by descending count (ties: ascending id)
    counts         their counts (same order)
    total_tokens   tokens counted
    source         how it was made (script, seed, split, files, token cap, tokenizer hash)

The held-out files are never read past the split. Deterministic for a given machine and seed.

    nice -n 10 .venv/bin/python scripts/token_frequencies.py
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prepare_data as prep  # noqa: E402  (the sibling script: the same collection and split)


def count_tokens(tok, texts: list[str], eos_id: int, cap: int) -> tuple[np.ndarray, int, int]:
    """(counts [vocab] int64, tokens counted, files counted) of the stream ``text0 <eos> text1 ...``,
    stopping before the first file that would pass ``cap`` tokens (as ``prepare_data.encode_stream``)."""
    ids, nfiles = prep.encode_stream(tok, texts, eos_id, cap)
    return np.bincount(ids.astype(np.int64), minlength=tok.get_vocab_size()), int(ids.size), nfiles


def frequency_table(counts: np.ndarray) -> tuple[list[int], list[int]]:
    """Ids by descending count, ties by ascending id (a stable sort of -counts), and their counts."""
    order = np.argsort(-counts, kind="stable")
    return order.tolist(), counts[order].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--min-bytes", type=int, default=200)
    ap.add_argument("--max-bytes", type=int, default=256 * 1024)
    ap.add_argument("--max-tokens", type=int, default=4_000_000, help="train tokens counted (a stream prefix)")
    ap.add_argument("--model-dir", type=Path, default=prep.REPO / "models" / "bole-tiny-coder")
    ap.add_argument("--roots", type=Path, nargs="*", default=None)
    ap.add_argument("--manifest-in", type=Path, default=None,
                    help="use only the files (path + sha256) of an earlier .data/manifest.json.gz")
    args = ap.parse_args(argv)
    t0 = time.time()
    from tokenizers import Tokenizer

    tok_path = args.model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    roots = args.roots if args.roots else prep.source_roots()
    files, stats = prep.collect_files(roots, args.min_bytes, args.max_bytes)
    if args.manifest_in:
        with gzip.open(args.manifest_in, "rt") as fh:
            wanted = {(r["path"], r["sha256"]) for r in json.load(fh)["files"]}
        files = [f for f in files if (f["path"], f["hash"]) in wanted]
    file_set_sha256 = hashlib.sha256("".join(f"{f['path']}\0{f['hash']}\n" for f in files).encode()).hexdigest()
    train, heldout = prep.split_files(files, args.seed, args.heldout_frac)
    print(f"[{time.time() - t0:6.1f}s] files {len(files)}: train {len(train)}, held-out {len(heldout)} (not read)")
    counts, total, nfiles = count_tokens(tok, [f["text"] for f in train], tok.token_to_id(prep.EOS), args.max_tokens)
    ids, ordered = frequency_table(counts)
    out = {
        "token_ids": ids, "counts": ordered, "total_tokens": total,
        "source": {"script": "scripts/token_frequencies.py", "seed": args.seed, "heldout_frac": args.heldout_frac,
                   "split": "train", "files_kept": stats["kept"], "train_files": len(train),
                   "counted_files": nfiles, "max_tokens": args.max_tokens, "file_set_sha256": file_set_sha256,
                   "tokenizer_sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(),
                   "python": sys.version.split()[0]},
    }
    path = args.model_dir / "token_frequencies.json"
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    top = sum(ordered[:1024]) / max(1, total)
    print(f"[{time.time() - t0:6.1f}s] {total:,} tokens from {nfiles} files -> {path} "
          f"(top 1024 ids cover {top:.1%}; {sum(c > 0 for c in ordered)} ids seen)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
