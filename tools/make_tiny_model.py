#!/usr/bin/env python
"""Build (once) the tiny random-init Qwen2 + locally trained tokenizer; prints its folder."""

import argparse

from dora_hpc.engine.local_models import build_tiny_model

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="folder (default: $DORA_HPC_CACHE or ~/.cache/dora_hpc)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build_tiny_model(args.out, seed=args.seed))
