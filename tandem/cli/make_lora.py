"""``tandem make-lora BASE OUT``: write a seeded random LoRA adapter (PEFT's format) for
a local checkpoint, to try ``--enable-lora`` without training one.

The adapter loads in PEFT as in Tandem (``tandem.tools.lora_maker``). torch is imported
only when the command runs.
"""

from __future__ import annotations

import argparse

from tandem.cli.options import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "make-lora", "write a random LoRA adapter for a checkpoint", __doc__
    )
    p.add_argument("base_dir", help="the base model's HuggingFace checkpoint directory")
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (default 16)")
    p.add_argument(
        "--targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        help="comma-separated module names (default: all seven projections)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--rslora", action="store_true", help="rsLoRA scaling alpha / sqrt(r)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tandem.tools.lora_maker import make_lora

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    out = make_lora(
        args.base_dir, args.out_dir, args.rank, args.alpha, targets, args.seed, args.rslora
    )
    print(f"wrote a rank-{args.rank} LoRA adapter on {','.join(targets)} to {out}")
    return 0
