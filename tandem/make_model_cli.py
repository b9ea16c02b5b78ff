"""``tandem make-model``: write a random-weight HF checkpoint for tests and benchmarks.

The maker needs torch, so it is imported only when the command runs; ``tandem --help``
stays torch-free. The choices are spelled out here rather than read from the maker's
tables for the same reason; ``engine.checkpoint_maker`` validates them again.
"""

from __future__ import annotations

import argparse
import sys
import time

ARCHS = ("llama", "qwen2", "mistral")
SIZES = ("tiny", "small", "medium")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("none", "linear", "llama3")
CONFIG_STYLES = ("legacy", "v5")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight HuggingFace checkpoint (no download)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default="none")
    p.add_argument(
        "--config-style",
        choices=CONFIG_STYLES,
        default="legacy",
        help="legacy: rope_theta + rope_scaling; v5: rope_parameters (transformers 5)",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset's KV heads")
    p.add_argument(
        "--sliding-window", type=int, default=None, help="override the window (mistral only)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.checkpoint_maker import make_model

    start = time.perf_counter()
    try:
        path = make_model(
            args.out_dir,
            arch=args.arch,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            rope_scaling=args.rope_scaling,
            config_style=args.config_style,
            vocab_size=args.vocab_size,
            kv_heads=args.kv_heads,
            sliding_window=args.sliding_window,
        )
    except ValueError as e:
        print(f"tandem make-model: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.arch}/{args.size} checkpoint to {path} in {time.perf_counter() - start:.1f}s"
    )
    return 0
