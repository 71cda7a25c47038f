"""``lmcache-p2p bench ...`` commands: our path and its baseline measured in the same run."""
