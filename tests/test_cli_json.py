"""``--json`` on ``lmcache-p2p invalidate``: the result as one JSON object on stdout, against a real etcd and
a real agent process holding chunks (the demo's ``--json`` is checked in ``test_demo.py``, where the demo runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from agent_helpers import AgentProcess, agent_yaml, stop_process, wait_until

from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.schema import Schema

TOKENS = 1024 + 100  # 5 chunks


def invalidate(etcd, cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    return subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", ",".join(etcd.endpoints),
                           "--cluster", cluster, *args], capture_output=True, text=True, timeout=60, env=env)


def entries(etcd, cluster: str) -> int:
    async def read() -> int:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints, timeout_s=3.0)) as client:
            return len((await client.get_prefix(Schema(cluster).blocks))[0])

    return asyncio.run(read())


def test_invalidate_json_reports_what_it_issued_and_what_its_wait_removed(etcd, cluster_name, tmp_path: Path):
    # a lease that outlives the test: a stopped agent's entries must stay for its wait to time out (with the
    # default 3 s a loaded machine let b's lease run out first, and the wait saw its entries go)
    agents = {node: AgentProcess(agent_yaml(tmp_path / f"{node}.yaml", node=node, cluster=cluster_name,
                                            endpoints=etcd.endpoints, ttl=120),
                                 seeds=(seed,), tokens=TOKENS, log=tmp_path / f"{node}.log")
              for node, seed in (("a", 1), ("b", 2))}
    try:
        for agent in agents.values():
            agent.wait_ready()
        assert wait_until(lambda: entries(etcd, cluster_name) == 10, 10)
        # a runs: it applies the invalidation, the wait sees its 5 entries go
        r = invalidate(etcd, cluster_name, "--node", "a", "--wait", "30", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        done = json.loads(r.stdout)  # the whole of stdout is the one object
        assert done["kind"] == "node" and done["value"] == "a" and done["cluster"] == cluster_name, done
        assert done["matched_entries"] == 5 and done["matched_objects"] == 0 and done["revision"] > 0, done
        assert done["wait"] == {"done": True, "removed": 5, "remaining": 0, "seconds": done["wait"]["seconds"]}, done
        # b is stopped: nothing removes its entries, the wait times out (exit 1), reported as not done
        stop_process(agents["b"].proc.pid)
        r = invalidate(etcd, cluster_name, "--node", "b", "--wait", "1", "--json")
        assert r.returncode == 1, r.stdout + r.stderr
        late = json.loads(r.stdout)
        assert late["matched_entries"] == 5 and late["wait"]["done"] is False, late
        assert late["wait"]["remaining"] == 5 and late["wait"]["removed"] == 0 and late["id"] != done["id"], late
        # without --wait: no wait key; without --json: the text lines, not JSON
        r = invalidate(etcd, cluster_name, "--node", "a", "--json")
        assert r.returncode == 0 and "wait" not in json.loads(r.stdout), r.stdout + r.stderr
        r = invalidate(etcd, cluster_name, "--node", "a")
        assert r.returncode == 0 and r.stdout.startswith("issued invalidate/") and "{" not in r.stdout, r.stdout
    finally:
        for agent in agents.values():
            agent.stop()


def test_invalidate_json_keeps_errors_off_stdout(etcd, cluster_name):
    r = invalidate(etcd, cluster_name, "--fingerprint", "xyz", "--json")  # not hex
    assert r.returncode == 2 and r.stdout == "" and "lmcache-p2p invalidate:" in r.stderr, r
