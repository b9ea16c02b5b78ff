"""``tandem serve``: the whole cluster on this machine, until Ctrl-C.

With ``--demo`` it streams the answer to a sample request, then shuts down: the quick
start. Without ``--model`` it serves the default model, made (once) in the user cache.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

DEMO_PROMPT = "def fibonacci(n):"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run router + prefill + decode workers here")
    serve.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    serve.add_argument("--model-name")
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--redis-url", help="default: start an embedded Redis")
    serve.add_argument("--log-dir", type=Path, help="one log file per process (default: echo)")
    serve.add_argument("--demo", action="store_true", help="answer a sample request, then stop")
    serve.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for every worker, e.g. --worker-arg=--max-num-seqs=64",
    )
    serve.add_argument("--router-arg", action="append", default=[])
    serve.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tandem.launcher import ClusterSpec, LocalCluster

    model = args.model or str(default_model())
    spec = ClusterSpec(
        model_dir=model,
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        router_port=args.port,
        host=args.host,
        redis_url=args.redis_url,
        model_name=args.model_name,
        worker_args=tuple(args.worker_arg),
        router_args=tuple(args.router_arg),
        log_dir=args.log_dir,
    )
    cluster = LocalCluster(spec)
    print(f"starting {spec.num_prefill} prefill + {spec.num_decode} decode workers for {model}")
    with cluster:
        redis = cluster.redis_url + (" (embedded)" if cluster.redis else "")
        print(
            f"tandem serving {cluster.model_name!r} at {cluster.router_address}; registry {redis}"
        )
        if args.demo:
            return _demo(cluster.router_address)
        _wait_for_ctrl_c()
        print("stopping")
    return 0


def default_model() -> Path:
    """The built-in tiny model, made once under the user cache."""
    from engine.checkpoint_maker import make_model
    from engine.checkpoint_tokenizer import cache_dir

    path = cache_dir() / "models" / "tiny-llama"
    if not (path / "config.json").exists():
        make_model(path, arch="llama", size="tiny")
    return path


def _demo(address: str) -> int:
    from protos import common_pb2
    from tandem.client import stream_generate

    print(f"\n>>> {DEMO_PROMPT}")
    sampling = common_pb2.SamplingParams(max_tokens=48, temperature=0)
    for response in stream_generate(address, DEMO_PROMPT, sampling, timeout_s=120):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if response.HasField("usage"):
            u = response.usage
            print(
                f"\n\n[{u.prompt_tokens} prompt tokens, {u.completion_tokens} generated, "
                f"{u.cached_prompt_tokens} from the prefix cache]"
            )
    return 0


def _wait_for_ctrl_c() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
