"""``lmcache-p2p events``: the mesh's index changes as vLLM KV events, for KV-aware routers.

    lmcache-p2p events --etcd URL --bind tcp://*:5557 [--fingerprint HEX]

One process follows the index in etcd (the same watch-fed mirror every agent keeps, so a node's
death shows up when its lease ends and its entries go) and publishes, for every change, a
``KVEventBatch`` in the format vLLM's own KV event publisher uses (msgpack, ``BlockStored`` /
``BlockRemoved`` tagged structs), over ZMQ PUB as vLLM sends it: ``(topic, seq u64 BE, payload)``.

    topic       "<fingerprint hex>/<node id>": which engine (or TP rank, or cache-only agent) holds it
    block_hashes  [the 16-byte chunk key]: one entry per chunk of ``chunk_size`` tokens
    medium      "gpu" | "cpu" | "disk": the tier the node holds it in (a move between tiers is a
                BlockRemoved in the old tier, then a BlockStored in the new one)
    block_size  the chunk size in tokens; parent_block_hash and token_ids are not known to the
                index (keys are chained over the tokens: a router computes them with ``keys.py``)

A consumer decodes with ``msgspec.msgpack.Decoder(KVEventBatch)`` (vLLM's class or the one here);
``examples/kv_events_consumer.py`` is one, and the tests run it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time

import msgspec

from .aio import LoopThread
from .config import AgentConfig
from .ids import OBJECTS, TIER_NAMES, NodeId
from .index.reader import IndexReader
from .keys import ChunkKey, FingerprintDigest

log = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """vLLM's schema (``vllm.distributed.kv_events``): the same class names, fields and encoding."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # required (no default) in vLLM's schema: always encoded


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclasses.dataclass(slots=True)
class Change:
    node: NodeId
    key: ChunkKey
    old: int | None  # tier byte before (None: not held)
    new: int | None


def batch_of(change: Change, chunk_size: int) -> KVEventBatch:
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    if change.old is not None:
        events.append(BlockRemoved([bytes(change.key)], TIER_NAMES.get(change.old)))
    if change.new is not None:
        events.append(BlockStored([bytes(change.key)], None, [], chunk_size, None, TIER_NAMES.get(change.new), None))
    return KVEventBatch(time.time(), events)


class EventPublisher:
    """Follows one fingerprint's index and publishes every owner change on a ZMQ PUB socket."""

    def __init__(self, config: AgentConfig, fp: FingerprintDigest, bind: str) -> None:
        import zmq

        self._config = config
        self._fp = fp
        self._queue: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(bind)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = itertools.count()
        self._loop = LoopThread("lmcache-p2p-events", role="events")
        self._reader: IndexReader | None = None
        self._thread = threading.Thread(target=self._send_forever, name="lmcache-p2p-events-pub", daemon=True)
        self.published = 0

    def start(self) -> EventPublisher:
        self._thread.start()
        # Events are every owner change: this reader follows the block entries even where the agents
        # only look up (etcd.index: lookup).
        watching = dataclasses.replace(self._config, etcd=dataclasses.replace(self._config.etcd, index="watch"))
        self._reader = IndexReader.open(self._loop, watching, self._fp)
        self._reader.mirror.on_block = self._on_block  # from now on; the state at start is replayed below
        for key, owners in self._reader.mirror.snapshot().items():
            for node, tier in owners.items():
                if node != OBJECTS:
                    self._queue.put(Change(node, key, None, tier))
        return self

    def _on_block(self, node: NodeId, key: ChunkKey, old: int | None, new: int | None) -> None:
        if node != OBJECTS:  # engines' caches only: the object store serves no requests
            self._queue.put(Change(node, key, old, new))  # on the loop: hand over, never block

    def _send_forever(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        fp_hex = self._fp.hex()
        while True:
            change = self._queue.get()
            if change is None:
                return
            payload = encoder.encode(batch_of(change, self._config.chunk_size))
            topic = f"{fp_hex}/{change.node}".encode()
            self._pub.send_multipart((topic, next(self._seq).to_bytes(8, "big"), payload))
            self.published += 1

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._loop.stop()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._ctx.term()


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventPublisher", "KVEventBatch"]
