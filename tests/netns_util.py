"""Separate hosts on one machine: Linux network namespaces joined by veth pairs, with
the links shaped (``tc``) or cut at will. Needs root (or CAP_NET_ADMIN) and ``ip``/``tc``.

The lab: a bridge in the test's own namespace (where Redis and the test client run),
one namespace per component on it, and a direct link between the prefill and decode
namespaces that carries the KV traffic (control channel, rendezvous store and gloo), so
it can be slowed, made lossy or partitioned without touching the router's links.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class LabUnavailable(Exception):
    """This machine cannot build the lab; the message says why."""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def check_privileges() -> None:
    """``LabUnavailable`` unless namespaces, veth pairs and tbf can be made here."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise LabUnavailable("needs the ip and tc commands (iproute2)")
    if os.geteuid() != 0:
        raise LabUnavailable("needs root (CAP_NET_ADMIN) to make network namespaces")
    probe = f"tdm-probe-{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
    except RuntimeError as err:
        raise LabUnavailable(f"cannot make a network namespace: {err}") from None
    try:
        _run("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
             "rate", "1mbit", "burst", "4kb", "latency", "50ms")  # fmt: skip
    except RuntimeError as err:
        raise LabUnavailable(f"cannot make a veth pair or a tbf qdisc: {err}") from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (delay and random loss)."""
    probe = f"tdm-netem-{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "netem",
             "delay", "1ms")  # fmt: skip
        return True
    except RuntimeError:
        return False
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # on the bridge
    link: str  # its veth end inside the namespace


@dataclass
class Lab:
    tag: str
    bridge: str
    gateway: str  # the test's own address on the bridge
    hosts: dict[str, Host]
    kv_addresses: tuple[str, str]  # prefill, decode ends of the direct link
    kv_links: tuple[str, str]

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def shape_kv_link(self, *qdisc: str) -> None:
        """Replace the root qdisc of both ends of the prefill-decode link."""
        for host, link in zip(("prefill", "decode"), self.kv_links, strict=True):
            _run(*self.exec_prefix(host), "tc", "qdisc", "replace", "dev", link, "root", *qdisc)

    def slow_kv_link(self, rate: str = "2mbit") -> None:
        """A narrow link: bulk KV transfers take seconds, small messages queue behind."""
        self.shape_kv_link("tbf", "rate", rate, "burst", "8kb", "latency", "200ms")

    def lossy_kv_link(self) -> None:
        """Delay and random loss with netem when the kernel has it; else a narrow tbf
        whose short queue drops what overflows it (loss under bursts)."""
        if netem_available():
            self.shape_kv_link("netem", "delay", "30ms", "10ms", "loss", "5%")
        else:
            self.shape_kv_link("tbf", "rate", "4mbit", "burst", "4kb", "limit", "8kb")

    def partition_kv_link(self) -> None:
        """Nothing passes, silently: a bucket smaller than any packet, a tiny queue."""
        self.shape_kv_link("tbf", "rate", "1kbit", "burst", "100", "limit", "100")

    def heal_kv_link(self) -> None:
        for host, link in zip(("prefill", "decode"), self.kv_links, strict=True):
            subprocess.run(
                [*self.exec_prefix(host), "tc", "qdisc", "del", "dev", link, "root"],
                capture_output=True,
            )


@contextlib.contextmanager
def network_lab(names: Sequence[str] = ("router", "prefill", "decode")) -> Iterator[Lab]:
    """Build the lab, yield it, tear it all down (namespaces, links, bridge)."""
    tag = f"{os.getpid() % 10000}"
    subnet, kv_subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}", "10.251.0"
    bridge = f"tdmbr{tag}"
    hosts = {
        name: Host(f"tdm-{name}-{tag}", f"{subnet}.{10 + i}", f"eth-{name[:4]}")
        for i, name in enumerate(names)
    }
    kv_links = ("kvlink", "kvlink")
    made: list[str] = []
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for i, host in enumerate(hosts.values()):
            _run("ip", "netns", "add", host.namespace)
            made.append(host.namespace)
            outside = f"tdm{tag}h{i}"
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", host.link)
            _run("ip", "link", "set", host.link, "netns", host.namespace)
            _run("ip", "link", "set", outside, "master", bridge)
            _run("ip", "link", "set", outside, "up")
            ns = ["ip", "-n", host.namespace]
            _run(*ns, "addr", "add", f"{host.address}/24", "dev", host.link)
            _run(*ns, "link", "set", host.link, "up")
            _run(*ns, "link", "set", "lo", "up")
        prefill, decode = hosts["prefill"], hosts["decode"]
        kv_prefill, kv_decode = f"{kv_subnet}.1", f"{kv_subnet}.2"
        _run("ip", "link", "add", "tdmkvp" + tag, "type", "veth", "peer", "name", "tdmkvd" + tag)
        for end, host, address in (
            ("tdmkvp" + tag, prefill, kv_prefill),
            ("tdmkvd" + tag, decode, kv_decode),
        ):
            _run("ip", "link", "set", end, "netns", host.namespace)
            ns = ["ip", "-n", host.namespace]
            _run(*ns, "link", "set", end, "name", "kvlink")
            _run(*ns, "addr", "add", f"{address}/24", "dev", "kvlink")
            _run(*ns, "link", "set", "kvlink", "up")
        # The prefill worker advertises its KV-link address; everyone else reaches it
        # over the bridge (a namespace accepts traffic for any of its own addresses).
        _run("ip", "route", "add", f"{kv_prefill}/32", "via", prefill.address)
        for name, host in hosts.items():
            if name not in ("prefill", "decode"):
                _run("ip", "-n", host.namespace, "route", "add", f"{kv_prefill}/32", "via",
                     prefill.address)  # fmt: skip
        yield Lab(tag, bridge, f"{subnet}.1", hosts, (kv_prefill, kv_decode), kv_links)
    finally:
        subprocess.run(["ip", "route", "del", f"{kv_subnet}.1/32"], capture_output=True)
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
