"""An owner agent in its own process, for tests and ``bench transfer``.

The child fills a CpuPool with deterministic chunks (:func:`demo_chunk`), serves it with a
:class:`TransferStack`, prints one JSON ``ready`` line and then answers JSON commands on stdin::

    {"cmd": "evict", "key": hex}      remove a chunk                -> {"ok": bool}
    {"cmd": "corrupt", "key": hex}    flip one byte in its slot      -> {"ok": bool}
    {"cmd": "pinned"}                 live pins in the pool          -> {"pinned": n}
    {"cmd": "rawsend", "port": p, "n": n}  blocking send of the first n slots' bytes to 127.0.0.1:p
    {"cmd": "cpu"}                    CPU seconds of the process so far (every thread)  -> {"cpu_s": s}
    {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import xxhash

from ..aio import LoopThread
from ..chunk import ChunkHeader, make_header
from ..config import AgentConfig, TierConfig, TransferConfig
from ..errors import TransferError
from ..ids import NodeId, PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from ..transfer.stack import TransferStack


def demo_chunk(seed: int, index: int, nbytes: int, fp: FingerprintDigest) -> tuple[ChunkHeader, np.ndarray]:
    """The same chunk in every process: key and payload derive from (seed, index)."""
    key = ChunkKey(xxhash.xxh3_128_digest(f"demo:{seed}:{index}".encode()))
    payload = np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8)
    return make_header(key, fp, payload.data, nbytes // 1024), payload


def _serve(args: argparse.Namespace) -> int:
    # Answers go to the original stdout; anything else that prints (NIXL, UCX) goes to stderr.
    global _out
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    fp = FingerprintDigest(bytes.fromhex(args.fingerprint))
    pool = CpuPool(args.slot_bytes * (args.chunks + args.spare), args.slot_bytes)
    keys = []
    for i in range(args.chunks):
        header, payload = demo_chunk(args.seed, i, args.chunk_bytes, fp)
        pool.put(header, payload.data)
        keys.append(header.key)
    config = AgentConfig(
        node_id=args.node_id,
        tiers=TierConfig(pin_timeout_s=args.pin_timeout),
        transfer=TransferConfig(transports=tuple(args.transports.split(",")), timeout_s=args.timeout,
                                payload_mac=args.payload_mac, tls_ca_cert=args.tls_ca, tls_cert=args.tls_cert,
                                tls_key=args.tls_key),
    )
    gc.collect()
    gc.freeze()  # keep full collections off the serving path (torch's objects are long-lived)
    loop = LoopThread("owner-loop")
    stack = TransferStack.build(config, pool, [fp], args.secret.encode())
    loop.run(stack.start(), 30)
    _reply({"ready": True, "port": stack.server.port, "pid": os.getpid(), "base": pool.base_address,
            "slot_bytes": pool.slot_bytes, "nixl": stack.nixl is not None})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "stats":
                _reply(dataclasses.asdict(stack.server.stats))
                continue
            _reply(_command(pool, cmd))
    finally:
        loop.run(stack.close(), 10)
        loop.stop()
    return 0


def _command(pool: CpuPool, cmd: dict[str, Any]) -> dict[str, Any]:
    if cmd["cmd"] == "evict":
        return {"ok": pool.remove(ChunkKey(bytes.fromhex(cmd["key"])))}
    if cmd["cmd"] == "corrupt":
        pin = pool.pin(ChunkKey(bytes.fromhex(cmd["key"])), 5.0)
        if pin is None:
            return {"ok": False}
        view = pool.slot_view(pin.slot, pin.header.length)
        view[len(view) // 2] ^= 0xFF
        pool.unpin(pin)
        return {"ok": True}
    if cmd["cmd"] == "pinned":
        return {"pinned": pool.pinned_count()}
    if cmd["cmd"] == "cpu":
        return {"cpu_s": time.process_time()}
    if cmd["cmd"] == "rawsend":
        with socket.create_connection(("127.0.0.1", cmd["port"]), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for slot in range(cmd["n"]):
                sock.sendall(pool.slot_view(slot, cmd["length"]))
        return {"ok": True}
    return {"error": f"unknown command {cmd['cmd']!r}"}


_out = sys.stdout


def _reply(msg: dict[str, Any]) -> None:
    _out.write(json.dumps(msg) + "\n")
    _out.flush()


class OwnerProcess:
    """Parent-side handle on an owner child process."""

    def __init__(self, secret: str, fingerprint: FingerprintDigest, chunks: int, chunk_bytes: int, *,
                 seed: int = 0, transports: str = "tcp", pin_timeout_s: float = 30.0, timeout_s: float = 5.0,
                 spare_slots: int = 4, slot_bytes: int | None = None, start_timeout_s: float = 60.0,
                 payload_mac: bool = False, tls: tuple[str, str, str] | None = None, node_id: str = "owner") -> None:
        """``tls``: (CA, certificate, key) files: the owner serves only mutual TLS under that CA.
        ``node_id``: the node it answers as (requesters must plan it under that id: ``peer``)."""
        env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
        argv = [sys.executable, "-m", "lmcache_p2p.testing.peer_process", "--secret", secret,
                "--fingerprint", fingerprint.hex(), "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes),
                "--slot-bytes", str(slot_bytes or chunk_bytes), "--seed", str(seed), "--transports", transports,
                "--pin-timeout", str(pin_timeout_s), "--timeout", str(timeout_s), "--spare", str(spare_slots),
                "--node-id", node_id]
        if payload_mac:
            argv.append("--payload-mac")
        if tls is not None:
            argv += ["--tls-ca", tls[0], "--tls-cert", tls[1], "--tls-key", tls[2]]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.fingerprint, self.seed, self.chunk_bytes, self.node_id = fingerprint, seed, chunk_bytes, node_id
        try:
            self.info = self._read(start_timeout_s)
            if not self.info.get("ready"):
                raise TransferError(f"owner process failed to start: {self.info}")
        except BaseException:
            self.kill()  # and close our ends of its pipes
            raise
        self.port: int = self.info["port"]
        self.pid: int = self.info["pid"]

    @property
    def peer(self) -> PeerAddress:
        return PeerAddress("127.0.0.1", self.port, NodeId(self.node_id))

    def key(self, index: int) -> ChunkKey:
        return demo_chunk(self.seed, index, 0, self.fingerprint)[0].key

    def cpu_s(self) -> float:
        """CPU seconds the owner process has used so far, every thread (``time.process_time``)."""
        return float(self.command({"cmd": "cpu"})["cpu_s"])

    def command(self, cmd: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise TransferError(f"owner process {self.proc.pid} did not answer (exit {self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def kill(self) -> None:
        """SIGKILL the owner (no goodbye) and close our ends of its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout_s)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> OwnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmcache_p2p.testing.peer_process")
    p.add_argument("--payload-mac", action="store_true")
    p.add_argument("--tls-ca")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--secret", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--slot-bytes", type=int, default=1 << 20)
    p.add_argument("--spare", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transports", default="tcp")
    p.add_argument("--pin-timeout", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--node-id", default="owner")
    return _serve(p.parse_args(argv))


if __name__ == "__main__":
    time.sleep(0)  # keep the module importable without side effects
    sys.exit(main())
