"""The mesh index in etcd: who holds which chunk, and which nodes are alive.

    EtcdBlockIndex (sync facade, BlockIndex)          MemoryIndex (fake, BlockIndex)
      ├── EtcdClient   one gRPC channel, errors -> IndexError_
      ├── Session      one lease, keep-alive, done/close/orphan
      ├── Publisher    desired state -> batched txns under the lease
      └── Mirror       range read at R + one watch from R+1 -> dict probes

See ``schema`` for the key layout.
"""

from .protocol import BlockIndex
from .schema import NodeRecord, Schema

__all__ = ["BlockIndex", "NodeRecord", "Schema"]
