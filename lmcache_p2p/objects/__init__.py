"""The object tier: an S3-compatible store under disk that the whole cluster shares.

    store.py      the S3 client (obstore) behind a small async API, every call bounded by a deadline,
                  every read by a size
    format.py     the object: a chunk and its uploader, encrypted and authenticated (AES-256-GCM) under a
                  key of the cluster secret and the tenant, bound to its name
    tier.py       uploads behind eviction, their etcd metas, cleanup of what expired or an invalidation covers
    transport.py  loads planned like a slow peer: bounded, authenticated, checked against the meta's epoch
    seaweed.py    a private SeaweedFS on loopback (``weed mini``): the tests, the demo and the bench
"""
