"""``tandem make-model``: write a HF checkpoint, random-weight or trained on the stdlib.

``--train`` trains the preset on the checkpoint maker's corpus (``tandem.tools.training``)
instead of drawing random weights; ``--train-pair`` trains a target and a smaller draft
for speculative decoding into ``OUT_DIR/target`` and ``OUT_DIR/draft``. Each trained
checkpoint records its losses in ``training.json``.

The maker needs torch, so it is imported only when the command runs; ``tandem --help``
stays torch-free. The choices are spelled out here rather than read from the maker's
tables for the same reason; ``tandem.tools.checkpoint_maker`` validates them again. Training
hyperparameters left unset take ``tandem.tools.training.TrainConfig``'s defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from tandem.cli.options import add_command

if TYPE_CHECKING:
    from tandem.tools.checkpoint_maker import CheckpointSpec

ARCHS = (
    "llama",
    "qwen2",
    "mistral",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)
SIZES = ("tiny", "small", "medium", "trained-target", "trained-draft", "trained-moe")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
CONFIG_STYLES = ("legacy", "v5")
DEFAULT_TRAIN_MINUTES = 10.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "make-model",
        "write a random-weight or stdlib-trained HuggingFace checkpoint (no download)",
        __doc__.splitlines()[0],
    )
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="model family")
    p.add_argument(
        "--size",
        "--preset",
        dest="size",
        choices=SIZES,
        help="size preset (default: tiny; trained-target when training)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the weights (and training)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="storage dtype")
    p.add_argument(
        "--rope-scaling", choices=ROPE_SCALINGS, default="none", help="RoPE scaling written"
    )
    p.add_argument(
        "--config-style",
        choices=CONFIG_STYLES,
        default="legacy",
        help="legacy: rope_theta + rope_scaling; v5: rope_parameters (transformers 5)",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary size")
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset's KV heads")
    p.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="override the preset's MLP width (a mixture of experts: each expert's)",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="override the window (mistral, phi3, gemma2, gemma3)",
    )
    _add_training_arguments(p)
    p.set_defaults(run=run)


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (instead of random weights)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="train the preset on the stdlib")
    mode.add_argument(
        "--train-pair",
        action="store_true",
        help="train a target (--preset) and a draft (--draft-preset) on the same corpus "
        "into OUT_DIR/target and OUT_DIR/draft",
    )
    g.add_argument(
        "--draft-preset", choices=SIZES, default="trained-draft", help="--train-pair: draft size"
    )
    g.add_argument(
        "--train-minutes",
        type=float,
        help=f"wall-clock budget per model (default: {DEFAULT_TRAIN_MINUTES:g} without "
        "--train-steps)",
    )
    g.add_argument("--train-steps", type=int, help="step budget per model (default: none)")
    g.add_argument("--train-batch-size", type=int, help="sequences per step (default: 16)")
    g.add_argument("--train-seq-len", type=int, help="tokens per sequence (default: 256)")
    g.add_argument("--train-lr", type=float, help="peak learning rate (default: 0.003)")
    g.add_argument(
        "--distill-weight",
        type=float,
        help="--train-pair: share of the draft's loss taken from the target's distribution "
        "(default: 0)",
    )
    g.add_argument(
        "--corpus-bytes", type=int, help="read only this much of the corpus (default: all)"
    )
    g.add_argument("--log-every", type=int, help="steps between logged losses (default: 25)")


def run(args: argparse.Namespace) -> int:
    if args.train or args.train_pair:
        return _run_training(args)
    from tandem.tools.checkpoint_maker import make_model

    start = time.perf_counter()
    try:
        path = make_model(args.out_dir, **_spec_fields(args, args.size or "tiny"))
    except ValueError as e:
        print(f"tandem make-model: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.arch}/{args.size or 'tiny'} checkpoint to {path} "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 0


def _run_training(args: argparse.Namespace) -> int:
    from tandem.tools.training import TrainConfig, train, train_pair

    try:
        config = TrainConfig(**_train_config_fields(args))
        target = _spec(args, args.size or "trained-target")
        if args.train_pair:
            draft = _spec(args, args.draft_preset)
            report = train_pair(args.out_dir, target, draft, config, log=print)
            print(f"wrote {args.out_dir}/target and {args.out_dir}/draft")
            print(f"target: {report.target.summary()}")
            print(f"draft:  {report.draft.summary()}")
            print(f"greedy agreement (draft == target): {report.greedy_agreement:.1%}")
            return 0
        trained = train(target, config, log=print)
    except ValueError as e:
        print(f"tandem make-model: error: {e}", file=sys.stderr)
        return 2
    path = trained.save(args.out_dir)
    print(f"wrote trained {args.arch}/{target.size} checkpoint to {path}")
    print(trained.report.summary())
    return 0


def _train_config_fields(args: argparse.Namespace) -> dict[str, object]:
    fields = {
        "steps": args.train_steps,
        "minutes": args.train_minutes,
        "batch_size": args.train_batch_size,
        "seq_len": args.train_seq_len,
        "lr": args.train_lr,
        "log_every": args.log_every,
        "distill_weight": args.distill_weight,
        "corpus_bytes": args.corpus_bytes,
    }
    if args.train_steps is None and args.train_minutes is None:
        fields["minutes"] = DEFAULT_TRAIN_MINUTES
    return {name: value for name, value in fields.items() if value is not None}


def _spec(args: argparse.Namespace, size: str) -> CheckpointSpec:
    from tandem.tools.checkpoint_maker import checkpoint_spec

    return checkpoint_spec(**_spec_fields(args, size))


def _spec_fields(args: argparse.Namespace, size: str) -> dict[str, object]:
    """The checkpoint's description from the command line, as keyword arguments."""
    return {
        "arch": args.arch,
        "size": size,
        "seed": args.seed,
        "dtype": args.dtype,
        "rope_scaling": args.rope_scaling,
        "config_style": args.config_style,
        "vocab_size": args.vocab_size,
        "kv_heads": args.kv_heads,
        "sliding_window": args.sliding_window,
        "intermediate_size": args.intermediate_size,
    }
