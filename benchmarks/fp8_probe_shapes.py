"""The FP8 start-up probe's figures for the Qwen2.5 shapes, eager and compiled decode (GPU; not a test).

    python benchmarks/fp8_probe_shapes.py [--shapes 0.5b 1.5b 7b] [--tokens 64] [--out probe.jsonl]

One JSON line per (shape, compiled): µs of one decode layer's projections per FP8 kernel and for bf16, as
``engine.ops.fp8_probe.fp8_probe`` times them at start, and the kernel the engine would pick ("bf16" where none
is ``fp8_probe.MIN_GAIN`` x faster).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from shapes import SHAPES

from hybridflow.engine.ops.fp8_probe import fp8_probe, pick_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = ap.parse_args()
    device = torch.device("cuda")
    for size in args.shapes:
        c = SHAPES[size]
        kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
        for compiled in (False, True):
            us = fp8_probe(
                c["hidden_size"], c["intermediate_size"], device, c["hidden_size"], kv,
                tokens=args.tokens, compiled=compiled, model_layers=c["num_hidden_layers"],
            )  # fmt: skip
            best, pays = pick_kernel(us)
            row = {"shape": size, "compiled": compiled, "pick": best if pays else "bf16"}
            row |= {k: round(v, 1) for k, v in us.items()}
            print(json.dumps(row), flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
