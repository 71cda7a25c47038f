"""The object tier: an S3-compatible store under disk that the whole cluster shares.

    store.py    the S3 client (obstore) behind a small async API, every call bounded by a deadline
    tier.py     uploads behind eviction, loads planned like a slow peer, cleanup of what expired or
                an invalidation covers
    seaweed.py  a private SeaweedFS on loopback (``weed mini``): the tests, the demo and the bench
"""
