"""A KV-aware router's view of the mesh: subscribe to ``lmcache-p2p events`` and keep who holds what.

    python examples/kv_events_consumer.py tcp://127.0.0.1:5557 [--seconds 10] [--json]

Decodes with vLLM's own ``KVEventBatch`` when vLLM is installed (the format is vLLM's), else with
``lmcache_p2p.events.KVEventBatch``. Keeps ``held[(node, chunk key hex)] = medium`` from the
BlockStored / BlockRemoved stream and prints one JSON line per event with ``--json``, then the
final table. The topic is ``<fingerprint hex>/<node id>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import zmq

try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
except ImportError:  # the same schema, without vLLM
    from lmcache_p2p.events import BlockRemoved, BlockStored, KVEventBatch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("endpoint")
    parser.add_argument("--seconds", type=float, default=10.0, help="listen this long, then print the table")
    parser.add_argument("--json", action="store_true", help="one JSON line per event as it arrives")
    args = parser.parse_args(argv)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(args.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    held: dict[tuple[str, str], str] = {}
    print(json.dumps({"subscribed": args.endpoint}), flush=True)
    deadline = time.monotonic() + args.seconds
    while (left := deadline - time.monotonic()) > 0:
        if not sub.poll(int(left * 1000)):
            break
        topic, seq, payload = sub.recv_multipart()
        node = topic.decode().split("/", 1)[1]
        batch = decoder.decode(payload)
        for event in batch.events:
            for block in getattr(event, "block_hashes", []):
                key = block.hex() if isinstance(block, bytes) else f"{block:032x}"
                if isinstance(event, BlockStored):
                    held[(node, key)] = event.medium or "?"
                elif isinstance(event, BlockRemoved):
                    held.pop((node, key), None)
                if args.json:
                    print(json.dumps({"seq": int.from_bytes(seq, "big"), "node": node, "key": key,
                                      "event": type(event).__name__, "medium": event.medium}), flush=True)
    print(json.dumps({"held": [[n, k, m] for (n, k), m in sorted(held.items())]}), flush=True)
    sub.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
