"""``coordinator provision init|add|revoke``: CA, certificates, Mosquitto config, device kits."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.commands.options import add_log_options

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    prov = sub.add_parser(
        "provision", help="CA, certificates, Mosquitto mTLS config with ACL, device kits"
    )
    steps = prov.add_subparsers(dest="step", required=True)
    init = steps.add_parser("init", help="a new fleet: CA, broker, coordinator, devices")
    init.add_argument("--out", type=Path, required=True, help="directory to create (keep it)")
    init.add_argument("--federation", default="default", help="federation name")
    init.add_argument("--devices", default="", help="comma-separated device ids")
    init.add_argument("--count", type=int, default=0, help="N devices named PREFIX001..")
    init.add_argument("--prefix", default="device-", help="prefix of counted device ids")
    init.add_argument(
        "--hostname",
        dest="hostnames",
        action="append",
        default=None,
        help="broker name or IP in its certificate (repeatable; default localhost, 127.0.0.1)",
    )
    init.add_argument("--broker-host", default="", help="host the kits connect to (first name)")
    init.add_argument("--port", type=int, default=8883, help="TLS listener port")
    init.add_argument(
        "--ws-port",
        type=int,
        default=0,
        help="also a listener of MQTT over WebSockets over TLS (wss://) on this port, with "
        "the same mutual TLS, for devices behind HTTPS-only firewalls (default: none; needs a "
        "Mosquitto built with WebSockets)",
    )
    init.add_argument("--listen", default="", help="broker bind address (default: all)")
    init.add_argument(
        "--broker-dir", default="", help="where OUT/broker will be on the broker host"
    )
    init.add_argument(
        "--broker-user", default="", help="give the server key to this user (mosquitto)"
    )
    init.add_argument("--days", type=int, default=825, help="validity of leaf certificates")
    init.add_argument("--archive", action="store_true", help="also write devices/ID.tar.gz")
    add = steps.add_parser("add", help="provision more devices in an existing fleet")
    add.add_argument("--out", type=Path, required=True, help="the fleet directory")
    add.add_argument("ids", nargs="*", help="device ids")
    add.add_argument("--count", type=int, default=0, help="N devices named PREFIX001..")
    add.add_argument("--prefix", default="device-", help="prefix of counted device ids")
    add.add_argument("--archive", action="store_true", help="also write devices/ID.tar.gz")
    rev = steps.add_parser("revoke", help="revoke devices (CRL; restart the broker after)")
    rev.add_argument("--out", type=Path, required=True, help="the fleet directory")
    rev.add_argument("ids", nargs="+", help="device ids")
    for p in (init, add, rev):
        add_log_options(p)


def run(args: argparse.Namespace) -> int:
    """``provision init|add|revoke``: what was written, and what to do with it."""
    from coordinator.ops import provision as pv

    if args.step == "revoke":
        broker_dir = pv.revoke_devices(args.out, args.ids)
        print(
            f"revoked {', '.join(args.ids)}: {broker_dir}/crl.pem rewritten, kits and public "
            "keys deleted.\nCopy crl.pem to the broker host and reload mosquitto (`systemctl "
            "reload mosquitto`, or SIGHUP): new connections are then checked against it; "
            "restart it to also cut the connections that are open."
        )
        return 0
    if args.step == "add":
        kits = pv.add_devices(
            args.out, args.ids, count=args.count, prefix=args.prefix, archive=args.archive
        )
        print("\n".join(f"kit: {k}" for k in kits))
        return 0
    named = [d for d in args.devices.split(",") if d]
    spec = pv.ProvisionSpec(
        federation=args.federation,
        devices=tuple(pv.device_ids(named, args.count, args.prefix)),
        hostnames=tuple(args.hostnames or ("localhost", "127.0.0.1")),
        broker_host=args.broker_host,
        port=args.port,
        ws_port=args.ws_port,
        listen=args.listen,
        broker_dir=args.broker_dir,
        broker_user=args.broker_user,
        days=args.days,
    )
    pv.provision(args.out, spec, archive=args.archive)
    print(pv.summary(args.out))
    return 0
