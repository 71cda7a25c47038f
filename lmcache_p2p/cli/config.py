"""``lmcache-p2p config get | set KEY=VALUE ... | watch``: the cluster config in etcd.

``--etcd URL[,URL...]`` (or ``LMCACHE_P2P_ETCD_ENDPOINTS``, or ``--config``: TLS and auth too, as
for an agent, see ``cli/common.py``) names the cluster's etcd. Without one, the command starts a
private etcd on loopback with a temporary data dir (the embedded default) and stops it on exit:
``get`` then shows the defaults and ``set`` validates and shows the result but nothing outlives the
command, so for get/set it is only a demo. ``watch`` prints the private etcd's endpoint on stderr,
so ``config set --etcd <it>`` from another shell changes what it shows. What the fields do in
running agents, and which need a restart: ``coordinator/apply.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from ..config import EtcdConfig
from ..coordinator.apply import FIELDS
from ..coordinator.cluster_config import ClusterConfig, parse_assignments
from ..coordinator.store import ConfigStore, ConfigWatcher
from ..errors import ConfigError, IndexError_
from ..index.client import EtcdClient
from .common import etcd_endpoints, etcd_tool_parser, tool_config


def _parser() -> argparse.ArgumentParser:
    p = etcd_tool_parser("lmcache-p2p config", "cluster config in etcd",
                         default_help="config/env, else start a private etcd")
    p.add_argument("--timeout", type=float, help="seconds per etcd request (default: etcd.timeout_s)")
    sub = p.add_subparsers(dest="command", required=True)
    get = sub.add_parser("get", help="print the config")
    get.add_argument("--json", action="store_true")
    put = sub.add_parser("set", help="change fields: KEY=VALUE ...; refused unless the result is valid")
    put.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    watch = sub.add_parser("watch", help="print the config, then every change, one JSON line each")
    watch.add_argument("--count", type=int, default=0, help="exit after this many lines (0: forever)")
    watch.add_argument("--duration", type=float, default=0.0, help="exit after this many seconds (0: never)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    config = tool_config(args, "lmcache-p2p config", require_endpoints=False)  # TLS and auth as agents have them
    if args.timeout is not None:
        config = dataclasses.replace(config, etcd=dataclasses.replace(config.etcd, timeout_s=args.timeout))
    args.cluster = config.cluster
    try:
        with etcd_endpoints(config, "lmcache-p2p config", private_ok=True) as config:
            return asyncio.run(_run(args, config.etcd))
    except ConfigError as exc:
        print(f"error: invalid cluster config: {exc}", file=sys.stderr)
        return 2
    except IndexError_ as exc:
        print(f"error: etcd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


async def _run(args: argparse.Namespace, config: EtcdConfig) -> int:
    async with EtcdClient(config) as client:
        store = ConfigStore(client, args.cluster)
        if args.command == "get":
            current, _ = await store.get()
            _print(current, as_json=args.json)
        elif args.command == "set":
            new = await store.update(parse_assignments(args.assignments))
            _print(new, as_json=False)
        else:
            await _watch(client, args)
    return 0


async def _watch(client: EtcdClient, args: argparse.Namespace) -> None:
    seen: asyncio.Queue[ClusterConfig] = asyncio.Queue()
    watcher = ConfigWatcher(client, args.cluster, seen.put_nowait)
    await watcher.start()
    printed = 0
    try:
        async with asyncio.timeout(args.duration or None):
            while not args.count or printed < args.count:
                cfg = await seen.get()
                print(json.dumps(cfg.to_dict(), sort_keys=True), flush=True)
                printed += 1
    except TimeoutError:
        pass
    finally:
        await watcher.stop()


def _print(config: ClusterConfig, as_json: bool) -> None:
    data = config.to_dict()
    if as_json:
        print(json.dumps(data, sort_keys=True))
        return
    width = max(len(k) for k in data)
    shown = {name: "none" if value is None else str(value) for name, value in data.items()}
    vwidth = max(len(v) for v in shown.values())
    for name, value in shown.items():
        applies = FIELDS.get(name)  # (agent field, live): when running agents apply a change
        when = "" if applies is None else "live" if applies[1] else "at restart"
        print(f"{name:<{width}}  {value:<{vwidth}}  {when}".rstrip())
