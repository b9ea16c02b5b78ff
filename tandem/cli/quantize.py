"""``tandem quantize IN OUT``: write a weight-quantized copy of a float checkpoint.

The copy loads without the original (``LLM(OUT)``, ``--model OUT``) and gives the same
tokens as quantizing ``IN`` at load with the same settings; its layout is described in
``tandem.engine.quantization.checkpoint`` and docs/quantization.md. torch is imported
only when the command runs.
"""

from __future__ import annotations

import argparse

from tandem.cli.options import QUANTIZATIONS, add_command, quantization_group_size


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "quantize",
        "write an int8 / int4 weight-quantized copy of a checkpoint",
        __doc__.splitlines()[0],
    )
    p.add_argument("in_dir", help="float HuggingFace checkpoint directory")
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="int8", help="method")
    p.add_argument(
        "--group-size",
        type=quantization_group_size,
        default=64,
        help="int4: input channels per scale and zero point (32, 64 or 128)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize the output projection too (the embedding stays float)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.quantization.checkpoint import quantize_checkpoint
    from tandem.engine.quantization.scheme import QuantizationConfig, QuantMethod

    config = QuantizationConfig(
        QuantMethod(args.quantization), args.group_size, args.quantize_lm_head
    )
    count = quantize_checkpoint(args.in_dir, args.out_dir, config)
    print(f"quantized {count} weights to {args.quantization} in {args.out_dir}")
    return 0
