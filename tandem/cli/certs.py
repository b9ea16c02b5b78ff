"""``tandem certs``: a development CA and a certificate per component, for mutual TLS.

The files and what each is for are described in ``tandem.tools.certs``; the command
prints the flags that use them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.cli.options import add_command, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "certs",
        "make a development CA and per-component TLS certificates (mutual TLS)",
        __doc__.splitlines()[0],
    )
    p.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="a host name or IP the certificates are valid for, besides localhost, "
        "127.0.0.1, ::1 and tandem-internal (repeatable)",
    )
    p.add_argument(
        "--component",
        action="append",
        help="a certificate to make (repeatable; default: router, prefill, decode)",
    )
    p.add_argument("--days", type=positive_int, default=30, help="validity")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tandem.tools.certs import DEFAULT_COMPONENTS, FLEET_NAME, make_certs

    issued = make_certs(args.out_dir, args.component or DEFAULT_COMPONENTS, args.host, args.days)
    d = issued.directory
    print(f"wrote a CA ({issued.ca}) and certificates for {', '.join(issued.components)} in {d}")
    if "router" in issued.components:
        print(
            f"  router:  --ssl-certfile {issued.cert('router')} "
            f"--ssl-keyfile {issued.key('router')} --ssl-ca-certs {issued.ca}"
        )
    for role in ("prefill", "decode"):
        if role in issued.components:
            print(
                f"  {role}: --ssl-certfile {issued.cert(role)} "
                f"--ssl-keyfile {issued.key(role)} --ssl-ca-certs {issued.ca}"
            )
    print(f"  clients: --ssl-ca-certs {issued.ca}   (any host: --ssl-server-name {FLEET_NAME})")
    return 0
