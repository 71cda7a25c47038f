"""etcd roles as k8s/ sets them up, against a real etcd: k8s/generate-certs.sh issues the client
certificates, k8s/etcd-auth.sh (the script the Job in k8s/etcd-auth-job.yaml runs, with that Job's
environment and the Secret files the kustomization maps) turns on etcd auth, and then the agents'
certificate (CN lmcache-p2p-agent) runs a real agent, the router's (CN lmcache-p2p-router) reads the
cluster's keys but writes none, and a certificate from the same CA whose CN is no etcd user gets
nothing. Running the bootstrap again changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from agent_helpers import AgentProcess, agent_yaml, wait_until

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import AgentConfig, EtcdConfig
from lmcache_p2p.errors import IndexError_
from lmcache_p2p.index.client import EtcdClient, op_delete
from lmcache_p2p.index.etcd_server import EtcdCluster, etcd_binary
from lmcache_p2p.index.reader import IndexReader
from lmcache_p2p.index.schema import Schema
from lmcache_p2p.keys import FingerprintDigest

K8S = Path(__file__).resolve().parents[1] / "k8s"
SCRIPT = K8S / "etcd-auth.sh"
KUST = yaml.safe_load((K8S / "kustomization.yaml").read_text())
JOB = yaml.safe_load((K8S / "etcd-auth-job.yaml").read_text())
CONFIGMAP = yaml.safe_load((K8S / "configmap.yaml").read_text())
NODE = "lmcache-vllm-0"


def secret_files(k8s: Path, name: str) -> dict[str, Path]:
    """Key -> file (under the copy ``k8s``) of the kustomization's secretGenerator ``name``."""
    (gen,) = [g for g in KUST["secretGenerator"] if g["name"] == name]
    return {f.split("=")[0]: k8s / f.split("=")[-1] for f in gen["files"]}


def job_env(k8s: Path, endpoint: str) -> dict[str, str]:
    """The Job's environment, its mounted paths mapped to the Secret files they are (as in the pod)."""
    spec = JOB["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    env = {e["name"]: e["value"] for e in c["env"]}
    for name, value in env.items():
        base, _, key = value.rpartition("/")
        if "secret" in mounts.get(base, {}):
            env[name] = str(secret_files(k8s, mounts[base]["secret"]["secretName"])[key])
    assert env["ETCDCTL_ENDPOINTS"] == "https://lmcache-etcd:2379"
    env["ETCDCTL_ENDPOINTS"] = endpoint
    return env


def etcdctl() -> str:
    return str(Path(etcd_binary()).with_name("etcdctl"))


def bootstrap(k8s: Path, etcd: EtcdCluster) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **job_env(k8s, etcd.endpoint), "ETCDCTL": etcdctl()}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def agents_cluster() -> str:
    return str(yaml.safe_load(CONFIGMAP["data"]["agent.yaml"])["cluster"])


def client_config(etcd: EtcdCluster, k8s: Path, secret: str, cert: str) -> EtcdConfig:
    files = secret_files(k8s, secret)
    return EtcdConfig(endpoints=etcd.endpoints, ca_cert=str(files["ca.crt"]), cert_cert=str(files[f"{cert}.crt"]),
                      cert_key=str(files[f"{cert}.key"]), timeout_s=10.0)


def agent_config(etcd: EtcdCluster, k8s: Path) -> EtcdConfig:
    return client_config(etcd, k8s, "lmcache-p2p-etcd-client", "etcd-client")


def router_config(etcd: EtcdCluster, k8s: Path) -> EtcdConfig:
    return client_config(etcd, k8s, "lmcache-p2p-etcd-router", "etcd-router")


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of k8s/ with the certificates generate-certs.sh issues."""
    k8s = tmp_path_factory.mktemp("roles") / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("pki", "cluster-secret.txt", "router-key.txt"))
    subprocess.run([str(k8s / "generate-certs.sh")], check=True, timeout=120, capture_output=True,
                   env={**os.environ, "PYTHON": sys.executable})
    return k8s


@pytest.fixture(scope="module")
def etcd(k8s: Path) -> Iterator[EtcdCluster]:
    """A TLS etcd requiring client certificates from generate-certs.sh's etcd CA (it also issues its own
    server certificate and one named etcd-client, CN etcd-client: no etcd user), auth turned on by the
    bootstrap."""
    with EtcdCluster(1, unsafe_no_fsync=True, tls_dir=k8s / "pki/etcd") as cluster:
        first = bootstrap(k8s, cluster)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "Authentication Enabled" in first.stdout
        yield cluster


@pytest.fixture(scope="module")
def agent(etcd: EtcdCluster, k8s: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """A real agent of the Job's cluster with the agents' certificate, which has stored two chunks."""
    tmp = tmp_path_factory.mktemp("agent")
    cfg = agent_yaml(tmp / "a.yaml", node=NODE, cluster=agents_cluster(), endpoints=etcd.endpoints)
    ec = agent_config(etcd, k8s)
    cfg.write_text(cfg.read_text().replace(
        "etcd:\n", f"etcd:\n  ca_cert: {ec.ca_cert}\n  cert_cert: {ec.cert_cert}\n  cert_key: {ec.cert_key}\n", 1))
    proc = AgentProcess(cfg, seeds=(1,), tokens=512, log=tmp / "a.log").wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def test_the_job_bootstraps_the_agents_cluster():
    env = {e["name"]: e.get("value") for e in JOB["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CLUSTER"] == agents_cluster()


def test_the_agent_certificate_runs_an_agent_that_publishes(etcd: EtcdCluster, k8s: Path, agent: AgentProcess):
    schema = Schema(agents_cluster())

    async def published() -> list[bytes]:
        async with EtcdClient(agent_config(etcd, k8s)) as client:
            return [kv.key for kv in (await client.get_prefix(schema.root))[0]]

    assert wait_until(lambda: len(asyncio.run(published())) >= 3, 30)  # its node record and two chunks
    keys = asyncio.run(published())
    assert schema.node(NODE) in keys and sum(k.startswith(schema.blocks) for k in keys) >= 2
    assert agent.proc.poll() is None
    log = Path(agent._log.name).read_text()
    assert "INFO" in log and "permission denied" not in log.lower()  # nothing it does was refused


def test_the_agent_certificate_writes_nothing_outside_the_cluster_prefix(etcd: EtcdCluster, k8s: Path):
    async def run() -> None:
        async with EtcdClient(agent_config(etcd, k8s)) as client:
            await client.put(Schema(agents_cluster()).root + b"roles-test", b"ok")
            for key in (b"/elsewhere", Schema("other-cluster").root + b"config"):
                with pytest.raises(IndexError_, match="permission denied"):
                    await client.put(key, b"x")

    asyncio.run(run())


def test_the_router_certificate_reads_node_records_and_writes_nothing(etcd: EtcdCluster, k8s: Path,
                                                                       agent: AgentProcess):
    schema = Schema(agents_cluster())
    # Read as the router itself reads: an IndexReader following node records only, in lookup mode.
    config = dataclasses.replace(AgentConfig(cluster=agents_cluster()),
                                 etcd=dataclasses.replace(router_config(etcd, k8s), index="lookup"))
    with LoopThread("router-test") as loop:
        reader = IndexReader.open(loop, config, FingerprintDigest(b"\0" * 16))
        try:
            assert wait_until(lambda: NODE in reader.nodes(), 30)
        finally:
            reader.close()

    async def run() -> None:
        async with EtcdClient(router_config(etcd, k8s)) as client:
            kvs, _ = await client.get_prefix(schema.nodes)
            assert [kv.key for kv in kvs] == [schema.node(NODE)]
            for key in (schema.node("forged"), schema.config, schema.generation, b"/elsewhere"):
                with pytest.raises(IndexError_, match="permission denied"):
                    await client.put(key, b"x")
            with pytest.raises(IndexError_, match="permission denied"):
                await client.txn([], [op_delete(schema.node(NODE))])
            assert (await client.get(schema.node(NODE)))[0] is not None

    asyncio.run(run())


def test_a_certificate_of_the_etcd_ca_whose_cn_is_no_user_gets_nothing(etcd: EtcdCluster, k8s: Path):
    assert etcd.client_tls is not None
    ca, cert, key = etcd.client_tls  # issued by the same CA, CN etcd-client
    cfg = EtcdConfig(endpoints=etcd.endpoints, ca_cert=ca, cert_cert=cert, cert_key=key, timeout_s=10.0)

    async def run() -> None:
        async with EtcdClient(cfg) as client:
            with pytest.raises(IndexError_, match="permission denied"):
                await client.get_prefix(Schema(agents_cluster()).root)
            with pytest.raises(IndexError_, match="permission denied"):
                await client.put(Schema(agents_cluster()).node("forged"), b"x")

    asyncio.run(run())


def test_the_bootstrap_is_idempotent(etcd: EtcdCluster, k8s: Path):
    env = {**os.environ, **job_env(k8s, etcd.endpoint)}

    def state() -> str:
        out = []
        for what in (["user", "list"], ["role", "list"], ["auth", "status"]):
            out.append(subprocess.run([etcdctl(), *what], env=env, capture_output=True, text=True, check=True,
                                      timeout=60).stdout)
        for user in ("root", "lmcache-p2p-agent", "lmcache-p2p-router"):
            out.append(subprocess.run([etcdctl(), "user", "get", user], env=env, capture_output=True, text=True,
                                      check=True, timeout=60).stdout)
        for role in ("lmcache-p2p-rw", "lmcache-p2p-ro"):
            out.append(subprocess.run([etcdctl(), "role", "get", role], env=env, capture_output=True, text=True,
                                      check=True, timeout=60).stdout)
        # Everything but the auth revision, which each run's (unchanged) re-grants advance.
        return "".join(line for line in "".join(out).splitlines(keepends=True) if "Revision" not in line)

    before = state()
    again = bootstrap(k8s, etcd)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "created" not in again.stdout
    assert state() == before
    assert f"[/lmcache-p2p/v1/{agents_cluster()}/, /lmcache-p2p/v1/{agents_cluster()}0)" in before

