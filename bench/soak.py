"""Soak: mixed load on a real cluster for a set time while faults fire at random.

    python bench/soak.py --duration 180                 # what CI runs (tests/test_soak.py)
    python bench/soak.py --duration 3600 --json bench/results/soak-1h.json

The cluster is what ``tandem serve`` starts — a router, prefill and decode workers as
processes, Redis — supervised, so a component that dies is restarted with backoff. The
load is closed-loop (``--concurrency`` clients): prompts short (decode-only path) and
long (disaggregated, sharing prefixes), greedy and seeded sampling, and a share that the
client cancels after its first tokens. Meanwhile, every ``--fault-interval`` seconds on
average, one fault fires on a random worker:

- ``kill9-decode`` / ``kill9-prefill``: ``SIGKILL``;
- ``sigterm-decode`` / ``sigterm-prefill``: a graceful drain, as on a rollout;
- ``sigstop-decode``: frozen for 5-10 s (a stall), then ``SIGCONT``;
- ``redis-restart``: Redis stopped and started again on its port, empty.

Injected transfer faults run all along (``TANDEM_FAULTS`` in the workers: corrupted and
dropped KV sends, decode streams cut off without a finish reason).

Every request id ends in exactly one outcome, kept in a ledger: ``ok``, ``mismatch`` (a
greedy answer that differs from the offline engine's, token for token), ``cancelled``
(by the client, as planned), or the gRPC status code of its error. ``hung`` counts
requests that hit the client's deadline or never ended. After the load stops and the
faults settle, the workers must be back to every KV block free, no lease, no sequence;
what is still in use is ``leaked``. The run fails (exit 1) if anything is hung, leaked,
mismatched or without exactly one outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.metrics import Scrape
from tandem.common.redis_server import EmbeddedRedis
from tandem.protos import common_pb2, worker_pb2

FAULT_KINDS = (
    "kill9-decode",
    "kill9-prefill",
    "sigterm-decode",
    "sigterm-prefill",
    "sigstop-decode",
    "redis-restart",
)
TRANSFER_FAULTS = {
    "prefill-0": "kv.send:corrupt~0.05",
    "prefill-1": "kv.send:drop~0.03",
    "decode-1": "decode.stream:drop~0.003",
}
"""Injected all along, by worker (one fault point per process)."""
WORKER_ARGS = ("--num-kv-blocks", "192", "--max-num-seqs", "16", "--max-model-len", "512")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 180.0
    concurrency: int = 6
    fault_interval_s: float = 15.0
    faults: tuple[str, ...] = FAULT_KINDS
    transfer_faults: bool = True
    num_prefill: int = 2
    num_decode: int = 2
    cancel_share: float = 0.1
    greedy_share: float = 0.7
    request_timeout_s: float = 120.0
    settle_timeout_s: float = 90.0
    seed: int = 0
    model_dir: Path | None = None
    log_dir: Path | None = None


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int
    greedy_output: tuple[int, ...]


@dataclass
class Ledger:
    """One outcome per request id; a second one for the same id is itself a failure."""

    outcomes: dict[str, str] = field(default_factory=dict)
    issued: set[str] = field(default_factory=set)
    doubles: int = 0

    def issue(self, request_id: str) -> None:
        self.issued.add(request_id)

    def end(self, request_id: str, outcome: str) -> None:
        if request_id in self.outcomes:
            self.doubles += 1
        self.outcomes[request_id] = outcome

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())

    @property
    def unaccounted(self) -> int:
        return len(self.issued - set(self.outcomes))


@dataclass
class SoakReport:
    duration_s: float
    requests: int
    completed: int
    cancelled_by_client: int
    mismatched: int
    errors: dict[str, int]
    error_samples: dict[str, list[str]]
    hung: int
    unaccounted: int
    double_outcomes: int
    leaked_kv_blocks: int
    leaked_leases: int
    faults: dict[str, int]
    restarts: int
    migrations: int
    stalls: int
    prefill_retries: int
    kv_fallbacks_seen: int
    tokens_generated: int
    memory_growth_mb: dict[str, float]
    config: dict[str, object]

    @property
    def passed(self) -> bool:
        bad = self.hung + self.unaccounted + self.double_outcomes + self.mismatched
        return bad + self.leaked_kv_blocks + self.leaked_leases == 0


def make_prompts(model_dir: Path, rng: random.Random, vocab: int) -> list[Prompt]:
    """Short prompts (under the disaggregation threshold) and long ones, half of them on
    a shared prefix; their greedy outputs from the offline engine, the reference."""
    from tandem.engine import LLM, SamplingParams

    shared = [rng.randrange(vocab) for _ in range(64)]
    shapes = [(rng.randint(6, 24), False) for _ in range(8)]
    shapes += [(rng.randint(40, 160), i % 2 == 0) for i in range(16)]
    prompts: list[list[int]] = []
    for length, on_prefix in shapes:
        own = [rng.randrange(vocab) for _ in range(length)]
        prompts.append(shared + own if on_prefix else own)
    lengths = [rng.randint(8, 40) for _ in prompts]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_model_len=512)
    outputs = [
        llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    del llm
    return [
        Prompt(tuple(p), n, tuple(o.token_ids))
        for p, n, o in zip(prompts, lengths, outputs, strict=True)
    ]


class Soak:
    def __init__(self, config: SoakConfig, cluster: LocalCluster, redis: EmbeddedRedis) -> None:
        self.config = config
        self.cluster = cluster
        self.redis = redis
        self.rng = random.Random(config.seed)
        self.ledger = Ledger()
        self.faults: Counter[str] = Counter()
        self.tokens = 0
        self.stopped: set[str] = set()
        self.error_samples: dict[str, list[str]] = {}
        self._stop_load = asyncio.Event()

    # --- load --------------------------------------------------------------------------

    async def load(self, prompts: Sequence[Prompt], api: AsyncGenerationClient) -> None:
        async def client(index: int) -> None:
            rng = random.Random(self.config.seed * 1000 + index)
            while not self._stop_load.is_set():
                await self._one(api, rng, rng.choice(prompts))

        await asyncio.gather(*(client(i) for i in range(self.config.concurrency)))

    async def _one(self, api: AsyncGenerationClient, rng: random.Random, prompt: Prompt) -> None:
        request_id = f"soak-{uuid.uuid4().hex[:12]}"
        greedy = rng.random() < self.config.greedy_share
        cancel_after = 2 if rng.random() < self.config.cancel_share else None
        sampling = common_pb2.SamplingParams(
            max_tokens=prompt.max_tokens, ignore_eos=True, temperature=0 if greedy else 0.8
        )
        if not greedy:
            sampling.seed = rng.randrange(2**31)
        request = build_request(list(prompt.token_ids), sampling, request_id=request_id)
        self.ledger.issue(request_id)
        tokens: list[int] = []
        messages = 0
        call = api.generate(request, timeout_s=self.config.request_timeout_s)
        try:
            async for response in call:
                tokens += response.token_ids
                messages += 1
                if cancel_after is not None and messages >= cancel_after:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as error:
            code = error.code()
            hung = code is grpc.StatusCode.DEADLINE_EXCEEDED
            samples = self.error_samples.setdefault(code.name, [])
            if len(samples) < 5:
                samples.append(f"{request_id}: {error.details()}")
            self.ledger.end(request_id, "hung" if hung else code.name)
            return
        finally:
            self.tokens += len(tokens)
        if cancel_after is not None and messages >= cancel_after:
            self.ledger.end(request_id, "cancelled")
        elif (greedy and tuple(tokens) != prompt.greedy_output) or len(tokens) != prompt.max_tokens:
            self.ledger.end(request_id, "mismatch")
        else:
            self.ledger.end(request_id, "ok")

    def stop_load(self) -> None:
        self._stop_load.set()

    # --- faults ------------------------------------------------------------------------

    async def fault_schedule(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        while self.config.faults:
            wait = self.rng.uniform(0.5, 1.5) * self.config.fault_interval_s
            if time.monotonic() + wait >= until:
                return
            await asyncio.sleep(wait)
            kind = self.rng.choice(self.config.faults)
            fired = await loop.run_in_executor(None, self._fire, kind)
            if fired:
                self.faults[kind] += 1
        await asyncio.sleep(max(0.0, until - time.monotonic()))

    def _fire(self, kind: str) -> bool:
        if kind == "redis-restart":
            self.redis.stop()
            time.sleep(1.0)
            self.redis.start()
            print(f"[soak] {kind}", flush=True)
            return True
        action, role = kind.split("-")
        target = self._pick(role)
        if target is None:
            return False
        process = self.cluster.children[target].process
        print(f"[soak] {kind} {target} (pid {process.pid})", flush=True)
        if action == "kill9":
            process.send_signal(signal.SIGKILL)
        elif action == "sigterm":
            process.send_signal(signal.SIGTERM)
        else:
            self.stopped.add(target)
            process.send_signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(5.0, 10.0))
            process.send_signal(signal.SIGCONT)
            self.stopped.discard(target)
        return True

    def _pick(self, role: str) -> str | None:
        """A worker of ``role`` that is up, when every worker of that role is up (so a
        fault never takes down the last one)."""
        names = [n for n in self.cluster.children if n.startswith(f"{role}-")]
        up = [n for n in names if self._up(n)]
        if len(up) < len(names) or len(up) < 2:
            return None
        try:
            info = self.cluster.model_info()
        except grpc.RpcError:
            return None
        registered = info.num_decode_workers if role == "decode" else info.num_prefill_workers
        return self.rng.choice(up) if registered == len(names) else None

    def _up(self, name: str) -> bool:
        child = self.cluster.children[name]
        return child.ready.is_set() and child.process.poll() is None and name not in self.stopped

    # --- the end -----------------------------------------------------------------------

    def settle(self) -> tuple[int, int, int]:
        """Wait for every worker up and registered, then idle; ``(blocks in use,
        leases, fallbacks seen)`` at the end (0, 0, n when nothing leaked)."""
        deadline = time.monotonic() + self.config.settle_timeout_s
        names = [n for n in self.cluster.children if n != "router"]
        while time.monotonic() < deadline:
            if all(self._up(n) for n in names):
                try:
                    self.cluster.wait_for_workers(
                        self.config.num_prefill, self.config.num_decode, timeout_s=5
                    )
                    break
                except Exception:
                    pass
            time.sleep(0.5)
        in_use = leases = fallbacks = 0
        while True:
            statuses = [self._status(n) for n in names]
            in_use = sum(s.num_kv_blocks - s.num_free_kv_blocks for s in statuses)
            leases = sum(s.num_leases for s in statuses)
            busy = sum(s.num_running + s.num_waiting for s in statuses)
            fallbacks = sum(s.num_fallbacks for s in statuses)
            if in_use + leases + busy == 0 or time.monotonic() > deadline:
                return in_use, leases, fallbacks
            time.sleep(0.5)

    def _status(self, name: str) -> worker_pb2.WorkerStatus:
        return self.cluster.worker_status(name)


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
    return out


def router_counters(port: int) -> Scrape:
    return Scrape.of(f"http://127.0.0.1:{port}/metrics")


def run(config: SoakConfig) -> SoakReport:
    from tandem.tools.checkpoint_maker import make_model

    work = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    model_dir = config.model_dir or make_model(work / "model", arch="llama", size="tiny")
    log_dir = config.log_dir or work / "logs"
    rng = random.Random(config.seed)
    print(f"[soak] reference outputs from the offline engine ({model_dir})", flush=True)
    prompts = make_prompts(Path(model_dir), rng, vocab=4096)
    metrics_port = _free_port()
    redis = EmbeddedRedis(port=_free_port()).start()
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_prefill=config.num_prefill,
        num_decode=config.num_decode,
        router_port=_free_port(),
        redis_url=redis.url,
        model_name=f"soak-{uuid.uuid4().hex[:6]}",
        worker_args=WORKER_ARGS,
        prefill_args=("--lease-ttl", "10"),
        decode_args=("--kv-pull-timeout", "3"),
        router_args=(
            "--metrics-port",
            str(metrics_port),
            "--stall-timeout",
            "4",
            "--disaggregation-min-tokens",
            "32",
        ),
        threads_per_worker=1,
        log_dir=log_dir,
        restart=True,
        worker_env=(
            {n: {"TANDEM_FAULTS": f} for n, f in TRANSFER_FAULTS.items()}
            if config.transfer_faults
            else {}
        ),
    )
    cluster = LocalCluster(spec)
    print(f"[soak] starting the cluster; logs in {log_dir}", flush=True)
    try:
        cluster.start()
        soak = Soak(config, cluster, redis)
        started = time.monotonic()
        until = started + config.duration_s

        async def drive() -> dict[str, float]:
            async with AsyncGenerationClient(cluster.router_address) as api:
                load = asyncio.create_task(soak.load(prompts, api))
                await asyncio.sleep(min(20.0, config.duration_s / 6))  # warm, then measure
                pids = {n: c.process.pid for n, c in cluster.children.items()}
                memory_at_start = rss_mb(pids)
                await soak.fault_schedule(until)
                soak.stop_load()
                await load
                memory_at_end = rss_mb(
                    {n: p for n, p in pids.items() if cluster.children[n].process.pid == p}
                )
            return {
                n: round(memory_at_end[n] - memory_at_start[n], 1)
                for n in memory_at_end
                if n in memory_at_start
            }

        growth = asyncio.run(drive())
        elapsed = time.monotonic() - started
        print("[soak] load stopped; waiting for the cluster to settle", flush=True)
        in_use, leases, fallbacks = soak.settle()
        counters = router_counters(metrics_port)
        counts = soak.ledger.counts()
        errors = {
            k: v for k, v in counts.items() if k not in ("ok", "cancelled", "mismatch", "hung")
        }
        return SoakReport(
            duration_s=round(elapsed, 1),
            requests=len(soak.ledger.issued),
            completed=counts["ok"],
            cancelled_by_client=counts["cancelled"],
            mismatched=counts["mismatch"],
            errors=errors,
            error_samples=soak.error_samples,
            hung=counts["hung"] + soak.ledger.unaccounted,
            unaccounted=soak.ledger.unaccounted,
            double_outcomes=soak.ledger.doubles,
            leaked_kv_blocks=in_use,
            leaked_leases=leases,
            faults=dict(soak.faults),
            restarts=cluster.num_restarts,
            migrations=int(counters.value("router_decode_migrations_total")),
            stalls=int(counters.value("router_decode_stalls_total")),
            prefill_retries=int(counters.value("router_prefill_retries_total")),
            kv_fallbacks_seen=fallbacks,
            tokens_generated=soak.tokens,
            memory_growth_mb=growth,
            config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        )
    finally:
        cluster.stop()
        redis.stop()


def format_report(report: SoakReport) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(report.errors.items())) or "none"
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())) or "none"
    growth = ", ".join(f"{k} {v:+.1f}" for k, v in sorted(report.memory_growth_mb.items()))
    lines = [
        f"soak: {report.duration_s:.0f} s, {report.requests} requests, "
        f"{report.tokens_generated} tokens",
        f"  completed {report.completed}, cancelled by the client {report.cancelled_by_client}, "
        f"errors: {errors}",
        f"  faults: {faults}; restarts {report.restarts}",
        f"  decode migrations {report.migrations} (stalls {report.stalls}), prefill retries "
        f"{report.prefill_retries}, KV fallbacks on the last worker generation "
        f"{report.kv_fallbacks_seen}",
        f"  hung {report.hung}, leaked KV blocks {report.leaked_kv_blocks}, leaked leases "
        f"{report.leaked_leases}, mismatched {report.mismatched}, "
        f"outcomes missing {report.unaccounted} / doubled {report.double_outcomes}",
        f"  memory growth (MB, processes up all along): {growth or 'n/a'}",
        *(f"  e.g. {code}: {s}" for code, samples in report.error_samples.items() for s in samples),
        f"  {'PASS' if report.passed else 'FAIL'}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    p.add_argument("--fault-interval", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help=f"comma-separated kinds (default: all: {', '.join(FAULT_KINDS)}; 'none': no faults)",
    )
    p.add_argument(
        "--no-transfer-faults", action="store_true", help="no injected KV / stream faults"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="checkpoint (default: a tiny random Llama)")
    p.add_argument("--log-dir", type=Path, help="component logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the report here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = () if args.faults == "none" else tuple(k for k in args.faults.split(",") if k)
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        print(f"soak: unknown fault kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    config = SoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        fault_interval_s=args.fault_interval,
        faults=kinds,
        transfer_faults=not args.no_transfer_faults,
        seed=args.seed,
        model_dir=args.model,
        log_dir=args.log_dir,
    )
    report = run(config)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**asdict(report), "passed": report.passed, "machine": _machine()}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if report.passed else 1


def _machine() -> str:
    return f"{os.cpu_count()} cores, {sys.platform}, python {sys.version.split()[0]}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
