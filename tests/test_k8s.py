"""The manifests in k8s/ checked offline: Kubernetes schemas, and agreement with the code.

Every resource is validated (strict: unknown fields fail) against the Kubernetes JSON schemas shipped
with ``kubernetes-validate``, for the oldest and the newest Kubernetes we support. ServiceMonitor and
PrometheusRule are CRDs those schemas don't know: they are checked structurally (PrometheusRule in
``test_k8s_ops.py``, with promtool). Then the cross-references: the
ConfigMap's agent.yaml loads with :func:`load_config`; container ports, Services and ServiceMonitors
agree with it and with each other; every ``LMCACHE_P2P_*`` variable sets a real config field; the
vLLM kv-transfer-config names the connector; etcd's endpoints and --initial-cluster agree with the
Services; the Grafana dashboard only queries metrics that an agent or the router exposes, or vLLM's
allowed in ``test_k8s_ops.py``.

Each ``*_problems`` helper returns what is wrong; the tests assert it returns nothing, and the
mutation tests at the end assert it notices a deliberately broken copy.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_k8s_ops import VLLM_METRICS, exposed_series

from lmcache_p2p.cli import COMMANDS
from lmcache_p2p.config import ENV_PREFIX, AgentConfig, cluster_secret, load_config
from lmcache_p2p.identity import model_identity

K8S = Path(__file__).resolve().parents[1] / "k8s"
KUBE_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
AGENT_LABEL = "lmcache-p2p/agent"
CONFIG_MAP, CONFIG_KEY, CONFIG_PATH = "lmcache-p2p-config", "agent.yaml", "/etc/lmcache-p2p/agent.yaml"
Doc = dict[str, Any]
# etcd users (client certificate CNs) k8s/etcd-auth.sh creates: the agents' (read-write), the router's (read-only)
ETCD_USERS = {"agent": "lmcache-p2p-agent", "router": "lmcache-p2p-router"}
AUTH_JOB, ROOT_SECRET, ROUTER_SECRET = "lmcache-etcd-auth", "lmcache-p2p-etcd-root", "lmcache-p2p-etcd-router"


# --------------------------------------------------------------------------- loading

def load_manifests() -> list[tuple[str, Doc]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


MANIFESTS = load_manifests()
DOCS = [d for _, d in MANIFESTS]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def agent_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [(w, c) for w, c in containers(docs) if ENV_PREFIX + "NODE_ID" in env_of(c)]


def agent_yaml(docs: list[Doc]) -> str:
    return one(docs, "ConfigMap", CONFIG_MAP)["data"][CONFIG_KEY]


def config_of(docs: list[Doc], tmp_path: Path, env: dict[str, str] | None = None) -> AgentConfig:
    path = tmp_path / CONFIG_KEY
    path.write_text(agent_yaml(docs))
    return load_config(path, env=env or {})


def parse_quantity(q: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(q))
    assert m and m.group(2) in {"", *units}, f"bad quantity {q!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_selected(docs: list[Doc], selector: dict[str, str]) -> list[Doc]:
    return [w for w in workloads(docs) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def container_port(pod: Doc, target: int | str) -> int | None:
    for c in pod["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            if target in (p.get("name"), p["containerPort"]):
                return int(p["containerPort"])
    return None


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in an argument list."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def mounted_config_path_problems(workload: Doc, container: Doc, path: str) -> list[str]:
    """``path`` must be key agent.yaml of the agent ConfigMap, mounted in ``container``."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        base = m["mountPath"].rstrip("/")
        if m.get("subPath"):
            rel = m["subPath"] if path == base else None
        else:
            rel = path[len(base) + 1:] if path.startswith(base + "/") else None
        cm = volumes.get(m["name"], {}).get("configMap")
        if rel is None or cm is None:
            continue
        keys = {i["key"]: i["path"] for i in cm.get("items", [])} or {CONFIG_KEY: CONFIG_KEY}
        if cm["name"] == CONFIG_MAP and keys.get(CONFIG_KEY) == rel:
            return []
    return [f"{container['name']}: {path} is not {CONFIG_MAP}/{CONFIG_KEY} mounted in the container"]


# --------------------------------------------------------------------------- schemas

def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk
    for gen in kust.get("configMapGenerator", []):
        for f in gen["files"]:
            assert (K8S / f.split("=")[-1]).is_file(), f
    for gen in kust.get("secretGenerator", []):  # generated by generate-secret.sh, never committed
        for f in gen["files"]:
            path = "k8s/" + f.split("=")[-1]
            assert subprocess.run(["git", "check-ignore", "-q", path], cwd=K8S.parent).returncode == 0, path
    assert (K8S / "generate-secret.sh").stat().st_mode & 0o111
    assert kust["namespace"] in {d["metadata"]["name"] for d in of_kind(DOCS, "Namespace")}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in MANIFESTS if d["kind"] not in CRD_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_kubernetes_schema(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_bad_manifests():
    sts = copy.deepcopy(one(DOCS, "StatefulSet", "lmcache-etcd"))
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "2379"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBE_VERSIONS[-1], strict=True)
    svc = copy.deepcopy(one(DOCS, "Service", "lmcache-etcd"))
    svc["spec"]["selectr"] = svc["spec"].pop("selector")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_build_renders_valid_resources(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("cluster-secret.txt", "score-key.txt", "pki"))
    subprocess.run([str(k8s / "generate-secret.sh")], check=True, timeout=30, capture_output=True)
    subprocess.run([str(k8s / "generate-certs.sh")], check=True, timeout=60, capture_output=True,
                   env={**os.environ, "PYTHON": sys.executable})
    assert subprocess.run([str(k8s / "generate-certs.sh")], timeout=30, capture_output=True).returncode != 0
    key = (k8s / "cluster-secret.txt").read_text()
    assert len(key) == 64 and int(key, 16) and (k8s / "cluster-secret.txt").stat().st_mode & 0o077 == 0
    assert subprocess.run([str(k8s / "generate-secret.sh")], timeout=30, capture_output=True).returncode != 0
    out = subprocess.run(["kubectl", "kustomize", str(k8s)], capture_output=True, text=True, timeout=60, check=True)
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert len(rendered) == len(MANIFESTS) + len(kust.get("configMapGenerator", [])) + len(
        kust.get("secretGenerator", []))
    secret = one(rendered, "Secret", "lmcache-p2p-secret")
    assert base64.b64decode(secret["data"]["cluster-secret"]).decode() == key
    # the agents' score_api_key, which the router presents: a config value that loads (long enough)
    score_key = base64.b64decode(one(rendered, "Secret", "lmcache-p2p-router-key")["data"]["score-key"]).decode()
    assert AgentConfig(node_id="x", score_api_key=score_key).score_api_key == (k8s / "score-key.txt").read_text()
    for d in rendered:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == kust["namespace"], d["metadata"]["name"]
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, KUBE_VERSIONS[-1], strict=True)
    assert tls_problems(rendered, config_of(rendered, tmp_path), k8s / "pki") == []
    assert etcd_auth_problems(rendered, config_of(rendered, tmp_path), tmp_path) == []
    script = one(rendered, "ConfigMap", "lmcache-etcd-auth-script")["data"]["etcd-auth.sh"]
    assert script == (K8S / "etcd-auth.sh").read_text()
    dash = one(rendered, "ConfigMap", "lmcache-p2p-grafana-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["grafana-dashboard.json"]) == load_dashboard()


def servicemonitor_problems(sm: Doc) -> list[str]:
    problems = []
    if sm.get("apiVersion") != "monitoring.coreos.com/v1":
        problems.append(f"apiVersion {sm.get('apiVersion')!r}")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", sm["metadata"].get("name", "")):
        problems.append("metadata.name is not a DNS label")
    spec = sm.get("spec", {})
    unknown = set(spec) - {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels",
                           "podTargetLabels", "sampleLimit"}
    if unknown:
        problems.append(f"unknown spec fields {sorted(unknown)}")
    labels = spec.get("selector", {}).get("matchLabels")
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        problems.append("spec.selector.matchLabels must be a non-empty map of strings")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        problems.append("spec.endpoints must be a non-empty list")
    for ep in endpoints or []:
        if not isinstance(ep.get("port"), str):
            problems.append("each endpoint needs a port name")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not re.fullmatch(r"\d+(ms|s|m|h)", ep[key]):
                problems.append(f"endpoint {key} {ep[key]!r} is not a duration")
        if "path" in ep and not ep["path"].startswith("/"):
            problems.append("endpoint path must start with /")
    return problems


@pytest.mark.parametrize("sm", [d for _, d in MANIFESTS if d["kind"] == "ServiceMonitor"],
                         ids=lambda d: d["metadata"]["name"])
def test_servicemonitor_structure(sm):
    assert servicemonitor_problems(sm) == []


# --------------------------------------------------------------------------- agent config vs manifests

def test_agent_config_loads_with_the_expected_values(tmp_path):
    cfg = config_of(DOCS, tmp_path)
    assert cfg.chunk_size == 256
    assert cfg.transfer.transports == ("nixl", "tcp")
    assert (cfg.transfer.port, cfg.metrics_port) == (7470, 9470)
    assert cfg.transfer.listen_host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
    assert cfg.etcd.endpoints and cfg.tiers.disk_path
    assert cfg.transfer.secret is None, "a secret in the file would override LMCACHE_P2P_SECRET from the Secret"


def port_problems(docs: list[Doc], cfg: AgentConfig) -> list[str]:
    """Agent containers expose the config's ports; agent Services target them; ServiceMonitors match."""
    want = {"transfer": cfg.transfer.port, "metrics": cfg.metrics_port}
    problems = []
    agents = agent_containers(docs)
    if not agents:
        problems.append("no agent containers")
    for w, c in agents:
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for name, port in want.items():
            if ports.get(name) != port:
                problems.append(f"{w['metadata']['name']}/{c['name']}: port {name} = {ports.get(name)}, config {port}")
    for svc in of_kind(docs, "Service"):
        pods = pods_selected(docs, svc["spec"].get("selector", {}))
        if not pods:
            problems.append(f"Service {svc['metadata']['name']} selects no pods")
        for sp in svc["spec"]["ports"]:
            for pod in pods:
                got = container_port(pod, sp.get("targetPort", sp["port"]))
                is_agent = any(w is pod for w, _ in agents)
                if got is None or (is_agent and sp.get("name") in want and got != want[sp["name"]]):
                    problems.append(f"Service {svc['metadata']['name']} port {sp.get('name')} -> "
                                    f"{pod['metadata']['name']}: {got}")
    for sm in of_kind(docs, "ServiceMonitor"):
        picked = [s for s in of_kind(docs, "Service") if selects(sm["spec"]["selector"]["matchLabels"],
                                                                   s["metadata"].get("labels", {}))]
        if not picked:
            problems.append(f"ServiceMonitor {sm['metadata']['name']} selects no Service")
        for svc in picked:
            for ep in sm["spec"]["endpoints"]:
                if ep["port"] not in {p.get("name") for p in svc["spec"]["ports"]}:
                    problems.append(f"ServiceMonitor {sm['metadata']['name']}: {svc['metadata']['name']} "
                                    f"has no port {ep['port']!r}")
    return problems


def test_ports_services_and_servicemonitors_agree_with_config(tmp_path):
    docs = DOCS
    assert port_problems(docs, config_of(docs, tmp_path)) == []


def test_agent_servicemonitor_scrapes_the_metrics_port(tmp_path):
    docs = DOCS
    cfg = config_of(docs, tmp_path)
    sm = one(docs, "ServiceMonitor", "lmcache-agent")
    (svc,) = [s for s in of_kind(docs, "Service") if selects(sm["spec"]["selector"]["matchLabels"],
                                                               s["metadata"].get("labels", {}))]
    (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == sm["spec"]["endpoints"][0]["port"]]
    pods = pods_selected(docs, svc["spec"]["selector"])
    assert {w["metadata"]["name"] for w in pods} == {w["metadata"]["name"] for w, _ in agent_containers(docs)}
    assert {container_port(w, sp["targetPort"]) for w in pods} == {cfg.metrics_port}


def test_agent_pods_carry_the_agent_label():
    for w, _ in agent_containers(DOCS):
        assert w["spec"]["template"]["metadata"]["labels"].get(AGENT_LABEL) == "true"


TEST_SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def secret_keys(docs: list[Doc]) -> dict[str, set[str]]:
    """Secret name -> its keys: Secrets among the manifests and the kustomization's secretGenerator."""
    out: dict[str, set[str]] = {}
    for s in of_kind(docs, "Secret"):
        out.setdefault(s["metadata"]["name"], set()).update({**s.get("data", {}), **s.get("stringData", {})})
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for gen in kust.get("secretGenerator", []):
        out.setdefault(gen["name"], set()).update(f.split("=")[0] for f in gen.get("files", []))
        out[gen["name"]].update(lit.split("=")[0] for lit in gen.get("literals", []))
    return out


def config_env_fields() -> dict[str, str]:
    """Every environment variable the config honours -> its dotted field, from the dataclasses."""
    out = {ENV_PREFIX + "SECRET": "transfer.secret"}
    hints = typing.get_type_hints(AgentConfig)
    for f in dataclasses.fields(AgentConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            for g in dataclasses.fields(hints[f.name]):
                out[f"{ENV_PREFIX}{f.name}_{g.name}".upper()] = f"{f.name}.{g.name}"
        else:
            out[f"{ENV_PREFIX}{f.name}".upper()] = f.name
    return out


SAMPLE_FIELD_REFS = {"metadata.name": "lmcache-vllm-7d9f8c6b5-x2k4q", "status.podIP": "10.244.3.17",
                     "metadata.namespace": "lmcache-p2p", "spec.nodeName": "gpu-node-3"}


def env_problems(docs: list[Doc], tmp_path: Path) -> list[str]:
    """Each LMCACHE_P2P_* variable must name a config field and actually set it."""
    problems, known = [], config_env_fields()
    base = config_of(docs, tmp_path)
    for w, c in containers(docs):
        for name, e in env_of(c).items():
            if not name.startswith(ENV_PREFIX):
                continue
            where = f"{w['metadata']['name']}/{c['name']}: {name}"
            if name not in known:
                problems.append(f"{where} is not a config field")
                continue
            if name == ENV_PREFIX + "SECRET":
                ref = e.get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("key") not in secret_keys(docs).get(ref.get("name"), set()):
                    problems.append(f"{where} refers to a missing Secret key {ref}")
                if cluster_secret(base, env={name: TEST_SECRET}) != TEST_SECRET.encode():
                    problems.append(f"{where} is ignored by cluster_secret()")
                continue
            field_ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            value = e.get("value", SAMPLE_FIELD_REFS.get(field_ref or ""))
            secret_ref = e.get("valueFrom", {}).get("secretKeyRef")
            if secret_ref is not None:  # a Secret's key (e.g. score_api_key): it must exist, and a value set it
                if secret_ref.get("key") not in secret_keys(docs).get(secret_ref.get("name"), set()):
                    problems.append(f"{where} refers to a missing Secret key {secret_ref}")
                value = "s" * 32
            if value is None:
                problems.append(f"{where}: unsupported value source {e}")
                continue
            via_env = config_of(docs, tmp_path, env={name: value})
            via_override = load_config(tmp_path / CONFIG_KEY, env={}, overrides={known[name]: value})
            if via_env != via_override or (via_env == base and value != _get(base, known[name])):
                problems.append(f"{where} does not set {known[name]}")
    return problems


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_lmcache_env_var_sets_a_config_field(tmp_path):
    assert env_problems(DOCS, tmp_path) == []


def test_agent_identity_comes_from_the_downward_api():
    for w, c in agent_containers(DOCS):
        env = env_of(c)
        assert env[ENV_PREFIX + "NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env[ENV_PREFIX + "TRANSFER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "secretKeyRef" in env[ENV_PREFIX + "SECRET"]["valueFrom"], w["metadata"]["name"]


def service_link_env(docs: list[Doc]) -> dict[str, str]:
    """The variables kubelet injects for the namespace's Services when enableServiceLinks is on."""
    env = {}
    for svc in of_kind(docs, "Service"):
        n = svc["metadata"]["name"].upper().replace("-", "_")
        ip = "10.96.0.10"
        for i, p in enumerate(svc["spec"]["ports"]):
            proto, port = p.get("protocol", "TCP"), p["port"]
            url = f"{proto.lower()}://{ip}:{port}"
            if i == 0:
                env.update({f"{n}_SERVICE_HOST": ip, f"{n}_SERVICE_PORT": str(port), f"{n}_PORT": url})
            if p.get("name"):
                env[f"{n}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(port)
            pre = f"{n}_PORT_{port}_{proto}"
            env.update({pre: url, f"{pre}_PROTO": proto.lower(), f"{pre}_PORT": str(port), f"{pre}_ADDR": ip})
    return env


def test_service_links_cannot_leak_into_agent_config(tmp_path):
    docs = DOCS
    for w, _ in agent_containers(docs):
        assert w["spec"]["template"]["spec"].get("enableServiceLinks") is False, w["metadata"]["name"]
    config_of(docs, tmp_path, env=service_link_env(docs))  # and harmless even if links were on


def test_agent_config_is_mounted_where_it_is_read():
    docs = DOCS
    for w, c in agent_containers(docs):
        args = c.get("command", []) + c.get("args", [])
        kv = flag(args, "--kv-transfer-config")
        path = json.loads(kv)["kv_connector_extra_config"]["config"] if kv else flag(args, "--config")
        assert path == CONFIG_PATH, w["metadata"]["name"]
        assert mounted_config_path_problems(w, c, path) == []


def test_memory_and_disk_leave_room_for_the_tiers(tmp_path):
    docs = DOCS
    cfg = config_of(docs, tmp_path)
    for w, c in agent_containers(docs):
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        tmpfs = sum(parse_quantity(v["emptyDir"]["sizeLimit"]) for v in volumes.values()
                    if v.get("emptyDir", {}).get("medium") == "Memory")
        limit = parse_quantity(c["resources"]["limits"]["memory"])
        assert limit >= cfg.tiers.cpu_capacity + tmpfs + 4 * 2**30, w["metadata"]["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cfg.tiers.disk_path]
        vol = volumes[mount["name"]]
        if "emptyDir" in vol:
            assert parse_quantity(vol["emptyDir"]["sizeLimit"]) > cfg.tiers.disk_capacity, w["metadata"]["name"]


def test_env_references_in_args_are_defined():
    for w, c in containers(DOCS):
        defined = set(env_of(c))
        for arg in c.get("command", []) + c.get("args", []):
            for ref in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert ref in defined, f"{w['metadata']['name']}/{c['name']}: $({ref}) is not defined"


# --------------------------------------------------------------------------- vLLM and the standalone agent

def test_vllm_kv_transfer_config_names_the_connector(tmp_path):
    docs = DOCS
    cfg = config_of(docs, tmp_path)
    c = one(docs, "StatefulSet", "lmcache-vllm")["spec"]["template"]["spec"]["containers"][0]
    args = c["command"] + c["args"]
    kv = json.loads(flag(args, "--kv-transfer-config") or "null")
    assert kv["kv_connector"] == "LMCacheP2PConnector"
    assert kv["kv_connector_module_path"] == "lmcache_p2p.integrations.vllm"
    assert importlib.util.find_spec(kv["kv_connector_module_path"]) is not None
    assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
    assert args[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    block = int(flag(args, "--block-size") or 0)
    assert block == cfg.layout.block_size and cfg.chunk_size % block == 0
    # the identity the connector computes for the served model, as the cache-only agents must declare it
    served = model_identity(flag(args, "--model") or "", flag(args, "--revision"))
    assert served == cfg.layout.model_id, f"cache-only agents would serve {cfg.layout.model_id!r}, engines {served!r}"
    tp = int(flag(args, "--tensor-parallel-size") or 1)
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == tp


def rank_problems(docs: list[Doc], cfg: AgentConfig) -> list[str]:
    """A TP=N engine runs N agents on ports transfer.port + r and metrics_port + r (``rank_config``):
    each rank's ports are on the container, and every rank's metrics are scraped."""
    problems = []
    scraped = {(svc["metadata"]["name"], ep["port"]) for sm in of_kind(docs, "ServiceMonitor")
               for svc in of_kind(docs, "Service")
               if selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"].get("labels", {}))
               for ep in sm["spec"]["endpoints"]}
    for w, c in agent_containers(docs):
        tp = int(flag(c.get("command", []) + c.get("args", []), "--tensor-parallel-size") or 1)
        for rank in range(1, tp):
            for name, base in (("transfer", cfg.transfer.port), ("metrics", cfg.metrics_port)):
                got = container_port(w, f"{name}-r{rank}")
                if got != base + rank:
                    problems.append(f"{w['metadata']['name']}: port {name}-r{rank} = {got}, rank {rank} uses "
                                    f"{base + rank}")
            if not any(container_port(w, sp.get("targetPort", sp["port"])) == cfg.metrics_port + rank
                       for svc in of_kind(docs, "Service") if w in pods_selected(docs, svc["spec"]["selector"])
                       for sp in svc["spec"]["ports"] if (svc["metadata"]["name"], sp.get("name")) in scraped):
                problems.append(f"{w['metadata']['name']}: rank {rank}'s metrics are scraped by no ServiceMonitor")
    return problems


def test_tensor_parallel_pods_expose_and_scrape_every_rank(tmp_path):
    docs = DOCS
    c = one(docs, "StatefulSet", "lmcache-vllm")["spec"]["template"]["spec"]["containers"][0]
    assert int(flag(c["args"], "--tensor-parallel-size") or 1) > 1, "the manifests deploy TP > 1"
    assert rank_problems(docs, config_of(docs, tmp_path)) == []


def test_standalone_agent_runs_the_agent_command():
    c = one(DOCS, "StatefulSet", "lmcache-cache-agent")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][0] == "lmcache-p2p" and ("agent",) in COMMANDS
    assert c["command"][1:] == ["agent", "--config", CONFIG_PATH]


def router_problems(docs: list[Doc]) -> list[str]:
    """The router Deployment runs ``lmcache-p2p router`` on the mounted agent config, its probes ask paths
    the router serves, its Service reaches its port, and the vLLM pods publish an engine URL on their
    API port (the router finds them by it)."""
    from lmcache_p2p.cli.router import parser
    from lmcache_p2p.router.app import GET_PATHS

    problems = []
    dep = one(docs, "Deployment", "lmcache-router")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    if c["command"][:2] != ["lmcache-p2p", "router"] or ("router",) not in COMMANDS:
        problems.append(f"router command: {c['command'][:2]}")
    args = parser().parse_args(c["command"][2:])
    problems += mounted_config_path_problems(dep, c, args.config or "")
    port = container_port(dep, "http")
    if port != args.port:
        problems.append(f"router listens on {args.port}, its container port is {port}")
    served = set(GET_PATHS)
    for probe in ("readinessProbe", "livenessProbe"):
        path = c[probe]["httpGet"]["path"]
        if path not in served:
            problems.append(f"router {probe} asks {path}, which it does not serve")
    svc = one(docs, "Service", "lmcache-router")
    if not pods_selected(docs, svc["spec"]["selector"]) == [dep]:
        problems.append("Service lmcache-router selects other pods than the router's")
    for p in svc["spec"]["ports"]:
        if container_port(dep, p["targetPort"]) is None:
            problems.append(f"Service lmcache-router targets {p['targetPort']}, no such container port")
    vllm = one(docs, "StatefulSet", "lmcache-vllm")
    vc = vllm["spec"]["template"]["spec"]["containers"][0]
    url = env_of(vc).get("LMCACHE_P2P_ENGINE_URL", {}).get("value", "")
    api = int(flag(vc["args"], "--port") or 8000)
    if not url.endswith(f":{api}") or "$(POD_IP)" not in url or "POD_IP" not in env_of(vc):
        problems.append(f"vLLM pods publish engine_url {url!r}, not http://$(POD_IP):{api}")
    # the router presents the key the agents' /v1/score asks for: the same Secret key, mounted where it reads
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in dep["spec"]["template"]["spec"]["volumes"]}
    given = next(((volumes[n], args.score_key_file.removeprefix(path + "/")) for n, path in mounts.items()
                  if args.score_key_file and args.score_key_file.startswith(path + "/")), None)
    for w in (vllm, one(docs, "StatefulSet", "lmcache-cache-agent")):
        ref = env_of(w["spec"]["template"]["spec"]["containers"][0]).get("LMCACHE_P2P_SCORE_API_KEY", {})
        asked = ref.get("valueFrom", {}).get("secretKeyRef", {})
        if given is None or (asked.get("name"), asked.get("key")) != given:
            problems.append(f"{w['metadata']['name']}'s score_api_key {asked} is not what the router sends {given}")
    return problems


def test_the_router_deployment_agrees_with_the_router_and_the_engines():
    assert router_problems(DOCS) == []
    broken = copy.deepcopy(DOCS)
    c = one(broken, "Deployment", "lmcache-router")["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["httpGet"]["path"] = "/healthz"
    vc = one(broken, "StatefulSet", "lmcache-vllm")["spec"]["template"]["spec"]["containers"][0]
    next(e for e in vc["env"] if e["name"] == "LMCACHE_P2P_ENGINE_URL")["value"] = "http://$(POD_IP):9000"
    next(e for e in vc["env"] if e["name"] == "LMCACHE_P2P_SCORE_API_KEY")["valueFrom"]["secretKeyRef"]["key"] = "x"
    assert len(router_problems(broken)) == 3


# --------------------------------------------------------------------------- etcd

def etcd_problems(docs: list[Doc], cfg: AgentConfig) -> list[str]:
    problems = []
    sts = one(docs, "StatefulSet", "lmcache-etcd")
    name, n = sts["metadata"]["name"], sts["spec"]["replicas"]
    peer = one(docs, "Service", sts["spec"]["serviceName"])
    if peer["spec"].get("clusterIP") != "None" or not peer["spec"].get("publishNotReadyAddresses"):
        problems.append("peer Service must be headless and publish not-ready addresses")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    args, env = c["args"], env_of(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    host = f"$(POD_NAME).{peer['metadata']['name']}.$(POD_NAMESPACE).svc"
    members = {f"{name}-{i}": f"https://{name}-{i}.{peer['metadata']['name']}.$(POD_NAMESPACE).svc:{ports['peer']}"
               for i in range(n)}
    initial = dict(m.split("=", 1) for m in (flag(args, "--initial-cluster") or "").split(","))
    expect = {"--name": "$(POD_NAME)", "--initial-advertise-peer-urls": f"https://{host}:{ports['peer']}",
              "--advertise-client-urls": f"https://{host}:{ports['client']}",
              "--listen-client-urls": f"https://0.0.0.0:{ports['client']}",
              "--listen-peer-urls": f"https://0.0.0.0:{ports['peer']}"}
    problems += [f"{k} = {flag(args, k)!r}, expected {v!r}" for k, v in expect.items() if flag(args, k) != v]
    if initial != members or n != 3:
        problems.append(f"--initial-cluster {initial} does not list the {n} members {members}")
    if env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
        problems.append("POD_NAME must come from metadata.name")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    data_dir = flag(args, "--data-dir") or ""
    if not any(m["name"] in claims and data_dir.startswith(m["mountPath"]) for m in c["volumeMounts"]):
        problems.append(f"--data-dir {data_dir} is not on a volumeClaimTemplate")
    if not all(k in c for k in ("livenessProbe", "readinessProbe")):
        problems.append("etcd needs liveness and readiness probes")
    for ep in cfg.etcd.endpoints:
        m = re.fullmatch(r"(?:https?://)?([^:/]+):(\d+)", ep)
        svc_name = m.group(1).split(".")[0] if m else ""
        svcs = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == svc_name]
        sp = [p for s in svcs for p in s["spec"]["ports"] if m and p["port"] == int(m.group(2))]
        if not m or not svcs or svcs[0]["spec"].get("clusterIP") == "None" or not sp \
                or not selects(svcs[0]["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"]) \
                or container_port(sts, sp[0]["targetPort"]) != ports["client"]:
            problems.append(f"etcd endpoint {ep} is not the client Service of {name} on the client port")
    return problems


def test_etcd_cluster_and_endpoints_agree(tmp_path):
    docs = DOCS
    assert etcd_problems(docs, config_of(docs, tmp_path)) == []


ETCD_TLS_FLAGS = ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
                  "--peer-trusted-ca-file")


def secret_file(workload: Doc, container: Doc, path: str) -> tuple[str, str] | None:
    """``(secret name, key)`` when ``path`` is a key of a Secret volume mounted in ``container``."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        base = m["mountPath"].rstrip("/")
        secret = volumes.get(m["name"], {}).get("secret")
        if secret is not None and path.startswith(base + "/"):
            return secret["secretName"], path[len(base) + 1:]
    return None


def generated_files(name: str) -> dict[str, Path]:
    """Key -> source file of the kustomization's secretGenerator ``name``."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    gens = [g for g in kust.get("secretGenerator", []) if g["name"] == name]
    return {f.split("=")[0]: K8S / f.split("=")[-1] for g in gens for f in g.get("files", [])}


def transfer_tls_problems(docs: list[Doc], workload: Doc, container: Doc, paths: dict[str, str | None]) -> list[str]:
    """Each agent pod has a transfer certificate of its own, and its serving container sees no other
    pod's key: the transfer files are in an in-memory emptyDir that one init container fills from a
    Secret of per-pod pairs (keys ``<pod>.crt``/``<pod>.key`` for every pod the workload runs, and
    ``ca.crt``), which the agent container does not mount."""
    name = workload["metadata"]["name"]
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    pods = [f"{name}-{i}" for i in range(workload["spec"].get("replicas", 1))]
    problems: list[str] = []
    for field, path in paths.items():
        mount = next((m for m in container.get("volumeMounts", []) if (path or "").startswith(m["mountPath"] + "/")),
                     None)
        if mount is None or volumes.get(mount["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
            problems.append(f"{name}: {field}={path!r} is not on an in-memory emptyDir")
            continue
        fillers = [i for i in spec.get("initContainers", [])
                   if any(m["name"] == mount["name"] for m in i.get("volumeMounts", []))]
        script = " ".join(a for i in fillers for a in i.get("command", []) + i.get("args", []))
        sources = {volumes[m["name"]]["secret"]["secretName"] for i in fillers for m in i.get("volumeMounts", [])
                   if "secret" in volumes.get(m["name"], {})}
        if len(fillers) != 1 or len(sources) != 1 or "/" + Path(path or "").name not in script:
            problems.append(f"{name}: no init container copies {field} ({Path(path or '').name}) from a Secret")
            continue
        (secret,) = sources
        want = {"ca.crt"} | {f"{pod}.{ext}" for pod in pods for ext in ("crt", "key")}
        missing = want - secret_keys(docs).get(secret, set())
        if missing:
            problems.append(f"{name}: Secret {secret} has no {sorted(missing)} (one certificate per pod)")
        if any(volumes.get(m["name"], {}).get("secret", {}).get("secretName") == secret
               for m in container.get("volumeMounts", [])):
            problems.append(f"{name}/{container['name']} mounts {secret}: every pod's transfer key")
    return problems


def tls_problems(docs: list[Doc], cfg: AgentConfig, pki: Path | None = None) -> list[str]:
    """etcd speaks TLS with client-certificate auth; agents use https endpoints and etcd client
    files that are keys of Secrets mounted in every agent container, and transfer certificates of
    their own per pod (:func:`transfer_tls_problems`), in Secrets apart from the etcd client key;
    with ``pki`` (generated), :func:`pki_problems`."""
    problems = []
    sts = one(docs, "StatefulSet", "lmcache-etcd")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    args, have = c["args"], secret_keys(docs)
    for f in ETCD_TLS_FLAGS:
        where = secret_file(sts, c, flag(args, f) or "")
        if where is None or where[1] not in have.get(where[0], set()):
            problems.append(f"etcd {f}={flag(args, f)!r} is not a key of a mounted Secret")
    problems += [f"etcd runs without {f}" for f in ("--client-cert-auth", "--peer-client-cert-auth") if f not in args]
    if not all(ep.startswith("https://") for ep in cfg.etcd.endpoints):
        problems.append(f"agents reach etcd over plain HTTP: {cfg.etcd.endpoints}")
    files = {"etcd.ca_cert": cfg.etcd.ca_cert, "etcd.cert_cert": cfg.etcd.cert_cert, "etcd.cert_key": cfg.etcd.cert_key}
    transfer = {"transfer.tls_ca_cert": cfg.transfer.tls_ca_cert, "transfer.tls_cert": cfg.transfer.tls_cert,
                "transfer.tls_key": cfg.transfer.tls_key}
    for w, ac in agent_containers(docs):
        for field, path in files.items():
            where = secret_file(w, ac, path or "")
            if where is None or where[1] not in have.get(where[0], set()):
                problems.append(f"{w['metadata']['name']}: {field}={path!r} is not a key of a mounted Secret")
            elif field == "etcd.cert_key" and any(k.endswith(".key") and k != where[1] for k in have[where[0]]):
                problems.append(f"{w['metadata']['name']}: the etcd client key shares Secret {where[0]} with "
                                "other keys")
        problems += transfer_tls_problems(docs, w, ac, transfer)
    if pki is not None:
        problems += pki_problems(pki, sts, cfg)
    return problems


def generated_pki(pki: Path, secret: str) -> dict[str, Path]:
    """Key -> file under a generated ``pki`` (a copy of k8s/pki) of the secretGenerator ``secret``."""
    return {k: pki / f.relative_to(K8S / "pki") for k, f in generated_files(secret).items()}


def chains(cert: Path, ca: Path) -> tuple[bool, str]:
    r = subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, text=True)
    return r.returncode == 0, f"{r.stdout}{r.stderr}".strip()


def pki_problems(pki: Path, etcd_sts: Doc, cfg: AgentConfig) -> list[str]:
    """The generated certificates (``generate-certs.sh``): etcd's chain to the etcd CA and transfer
    certificates to a transfer CA of their own, neither to the other's (so no etcd certificate, which
    names no node and whose key the router holds too, passes the transfer TLS as a node); each
    transfer certificate names its pod; etcd's names cover the agents' endpoints and its peers."""
    problems = []
    etcd, client = generated_pki(pki, "lmcache-etcd-tls"), generated_pki(pki, "lmcache-p2p-etcd-client")
    transfer = generated_pki(pki, "lmcache-p2p-transfer-tls")
    pods = {k[:-4]: f for k, f in transfer.items() if k.endswith(".crt") and k != "ca.crt"}
    if not pods:
        problems.append("no per-pod transfer certificates in the secretGenerator lmcache-p2p-transfer-tls")
    router, root = generated_pki(pki, "lmcache-p2p-etcd-router"), generated_pki(pki, "lmcache-p2p-etcd-root")
    etcd_certs = [etcd["server.crt"], client["etcd-client.crt"], router["etcd-router.crt"], root["root.crt"]]
    for cert, cn in ((client["etcd-client.crt"], ETCD_USERS["agent"]),
                     (router["etcd-router.crt"], ETCD_USERS["router"]), (root["root.crt"], "root")):
        subject = subprocess.run(["openssl", "x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in",
                                  str(cert)], capture_output=True, text=True).stdout
        if re.findall(r"CN=([^,\s]+)", subject) != [cn]:
            problems.append(f"{cert.name}: CN is not {cn} (etcd's user for it): {subject.strip()!r}")
    for ca, own, other in ((etcd["ca.crt"], etcd_certs, list(pods.values())),
                           (transfer["ca.crt"], list(pods.values()), etcd_certs)):
        for cert in own:
            ok, out = chains(cert, ca)
            if not ok:
                problems.append(f"{cert.name} does not chain to {ca.parent.name}/{ca.name}: {out}")
        for cert in other:
            if chains(cert, ca)[0]:
                problems.append(f"{cert.name} chains to {ca.parent.name}/{ca.name} too: one CA for etcd and transfer")
    for secret in (client, router, root):
        if secret["ca.crt"] != etcd["ca.crt"]:
            problems.append("an etcd client Secret's ca.crt is not etcd's CA")
    for pod, cert in pods.items():
        out = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert)],
                             capture_output=True, text=True).stdout
        if f"URI:urn:lmcache-p2p:node:{pod}" not in re.split(r"[,\s]+", out):
            problems.append(f"{cert.name} does not name the pod {pod} (SANs: {out.strip()!r})")
    out = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                          str(etcd["server.crt"])], capture_output=True, text=True).stdout
    names = set(re.findall(r"DNS:([^,\s]+)", out))
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    peer = f"{etcd_sts['metadata']['name']}-0.{etcd_sts['spec']['serviceName']}.{kust['namespace']}.svc"
    wanted = [re.sub(r"^https://([^:/]+).*", r"\1", ep) for ep in cfg.etcd.endpoints] + [peer]
    for host in wanted:
        if not any(n == host or (n.startswith("*.") and host.split(".", 1)[-1] == n[2:]) for n in names):
            problems.append(f"etcd's certificate does not name {host} (SANs: {sorted(names)})")
    return problems


def test_generated_certificates_keep_etcd_and_transfer_apart(tmp_path):
    """generate-certs.sh (no kubectl needed): two CAs; and the check notices one CA for both."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("cluster-secret.txt", "pki"))
    subprocess.run([str(k8s / "generate-certs.sh")], check=True, timeout=60, capture_output=True,
                   env={**os.environ, "PYTHON": sys.executable})
    sts, cfg = one(DOCS, "StatefulSet", "lmcache-etcd"), config_of(DOCS, tmp_path)
    assert pki_problems(k8s / "pki", sts, cfg) == []
    shutil.copy(k8s / "pki/etcd/ca.crt", k8s / "pki/transfer/ca.crt")  # as if issued from the etcd CA
    shutil.copy(k8s / "pki/etcd/lmcache-p2p-agent.crt", k8s / "pki/transfer/lmcache-vllm-0.crt")
    shutil.copy(k8s / "pki/etcd/lmcache-p2p-agent.crt", k8s / "pki/etcd/lmcache-p2p-router.crt")
    problems = pki_problems(k8s / "pki", sts, cfg)
    assert "lmcache-p2p-agent.crt chains to transfer/ca.crt too: one CA for etcd and transfer" in problems
    assert any(p.startswith("lmcache-p2p-router.crt: CN is not lmcache-p2p-router") for p in problems)
    assert any(p.startswith("lmcache-vllm-0.crt does not name the pod lmcache-vllm-0") for p in problems)


def test_etcd_and_agents_use_tls_with_mounted_certificates(tmp_path):
    assert tls_problems(DOCS, config_of(DOCS, tmp_path)) == []


def pod_secrets(workload: Doc, container: Doc) -> set[str]:
    """The Secrets mounted in ``container`` (volumes) or read into its environment."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    mounted = {volumes.get(m["name"], {}).get("secret", {}).get("secretName")
               for m in container.get("volumeMounts", [])}
    env = {e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for e in container.get("env", [])}
    return (mounted | env) - {None}


def etcd_auth_problems(docs: list[Doc], cfg: AgentConfig, tmp_path: Path) -> list[str]:
    """etcd auth (etcd-auth-job.yaml): the Job runs the etcd-auth.sh of its ConfigMap for the agents'
    cluster and etcd endpoint with the root certificate, a Secret no other pod mounts; the script makes
    the users the certificates name, read-write for the agents and read-only for the router; the router
    mounts its own read-only certificate (and its config uses it), never the agents' Secret."""
    problems = []
    job = one(docs, "Job", AUTH_JOB)
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    script = next((m["mountPath"] + "/etcd-auth.sh" for m in c["volumeMounts"]
                   if volumes[m["name"]].get("configMap", {}).get("name") == "lmcache-etcd-auth-script"), None)
    if script is None or c["command"] != ["bash", script]:
        problems.append(f"Job {AUTH_JOB} does not run etcd-auth.sh from its ConfigMap: {c['command']}")
    if env.get("CLUSTER") != cfg.cluster:
        problems.append(f"Job {AUTH_JOB} sets up cluster {env.get('CLUSTER')!r}, the agents' is {cfg.cluster!r}")
    if env.get("ETCDCTL_ENDPOINTS") not in cfg.etcd.endpoints:
        problems.append(f"Job {AUTH_JOB} reaches etcd at {env.get('ETCDCTL_ENDPOINTS')}, not {cfg.etcd.endpoints}")
    have = secret_keys(docs)
    for name in ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY"):
        where = secret_file(job, c, env.get(name) or "")
        if where is None or where[0] != ROOT_SECRET or where[1] not in have.get(ROOT_SECRET, set()):
            problems.append(f"Job {AUTH_JOB}: {name}={env.get(name)!r} is not a key of the mounted {ROOT_SECRET}")
    text = (K8S / "etcd-auth.sh").read_text()
    for user, role in ((ETCD_USERS["agent"], "lmcache-p2p-rw"), (ETCD_USERS["router"], "lmcache-p2p-ro")):
        if f"{user}:{role}" not in text:
            problems.append(f"etcd-auth.sh does not give {user} the role {role}")
    if "lmcache-p2p-rw readwrite" not in text or "lmcache-p2p-ro read " not in text:
        problems.append("etcd-auth.sh: lmcache-p2p-rw must read and write, lmcache-p2p-ro only read")
    for w, wc in containers(docs):
        if ROOT_SECRET in pod_secrets(w, wc):
            problems.append(f"{w['metadata']['name']} mounts {ROOT_SECRET}: only the auth Job may")
    router = one(docs, "Deployment", "lmcache-router")
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    if pod_secrets(router, rc) & {"lmcache-p2p-etcd-client", ROOT_SECRET}:
        problems.append(f"the router mounts {sorted(pod_secrets(router, rc))}: a read-write etcd key")
    rcfg = config_of(docs, tmp_path, env={e["name"]: e["value"] for e in rc.get("env", []) if "value" in e})
    for field, path in (("etcd.ca_cert", rcfg.etcd.ca_cert), ("etcd.cert_cert", rcfg.etcd.cert_cert),
                        ("etcd.cert_key", rcfg.etcd.cert_key)):
        where = secret_file(router, rc, path or "")
        if where is None or where[0] != ROUTER_SECRET or where[1] not in have.get(ROUTER_SECRET, set()):
            problems.append(f"the router's {field}={path!r} is not a key of the mounted {ROUTER_SECRET}")
    for w, ac in agent_containers(docs):
        if pod_secrets(w, ac) & {ROUTER_SECRET, ROOT_SECRET}:
            problems.append(f"{w['metadata']['name']} mounts {sorted(pod_secrets(w, ac))}")
    return problems


def test_etcd_auth_job_and_the_router_read_only_certificate(tmp_path):
    assert etcd_auth_problems(DOCS, config_of(DOCS, tmp_path), tmp_path) == []


def readable_secret_problems(docs: list[Doc]) -> list[str]:
    """A pod that runs as a non-root user reads its Secret files (mode 0440, owned by root) only through fsGroup."""
    problems = []
    for w in [*workloads(docs), *of_kind(docs, "Job")]:
        spec = w["spec"]["template"]["spec"]
        sc = spec.get("securityContext", {})
        modes = [v["secret"].get("defaultMode", 0o644) for v in spec.get("volumes", []) if "secret" in v]
        if sc.get("runAsUser", 0) != 0 and any(m & 0o004 == 0 for m in modes) and "fsGroup" not in sc:
            problems.append(f"{w['metadata']['name']} runs as user {sc['runAsUser']} without fsGroup: its Secrets "
                            "are unreadable")
    return problems


def test_non_root_pods_can_read_their_secrets():
    assert readable_secret_problems(DOCS) == []


# --------------------------------------------------------------------------- Grafana dashboard

def metric_series() -> dict[str, set[str]]:
    """Every series name an agent and the router expose (built in-process), and the vLLM metrics the
    dashboard may use (``test_k8s_ops.VLLM_METRICS``, checked against vLLM's source there) -> label names."""
    out = {name: set(labels) for name, labels in exposed_series().items()}
    out.update({name: set(labels) for name, labels in VLLM_METRICS.items()})
    assert "lmcache_p2p_hit_tokens_total" in out and "lmcache_p2p_router_requests_total" in out
    return out


def panels(dashboard: Doc) -> Iterator[Doc]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "endpoint", "container"}


def dashboard_problems(dashboard: Doc) -> list[str]:
    series, problems = metric_series(), []
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in panels(dashboard)]
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    for p in panels(dashboard):
        for t in p.get("targets", []):
            expr = t["expr"]
            used = set(re.findall(r"\b(?:lmcache_p2p_\w+|vllm:\w+)", expr))
            problems += [f"{p['title']}: unknown metric {m}" for m in used - set(series)]
            allowed = TARGET_LABELS.union(*(series.get(m, set()) for m in used))
            if any(m.endswith("_bucket") for m in used):
                allowed = allowed | {"le"}
            labels = set(re.findall(r"\b(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
            for group in re.findall(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)", expr):
                labels |= {x.strip() for x in group.split(",") if x.strip()}
            problems += [f"{p['title']}: label {lb} not on {sorted(used)}" for lb in labels - allowed]
            for var in re.findall(r"\$(?:\{)?(\w+)", expr):
                if not var.startswith("__") and var not in variables:
                    problems.append(f"{p['title']}: undefined variable ${var}")
            if "histogram_quantile" in expr and not re.search(r"by\s*\([^)]*\ble\b", expr):
                problems.append(f"{p['title']}: histogram_quantile without `le` in by()")
    return problems


REQUIRED_METRICS = {
    "lmcache_p2p_hit_tokens_total", "lmcache_p2p_miss_tokens_total", "lmcache_p2p_pull_bytes_total",
    "lmcache_p2p_pull_seconds_bucket", "lmcache_p2p_tier_used_bytes", "lmcache_p2p_tier_capacity_bytes",
    "lmcache_p2p_evictions_total", "lmcache_p2p_index_chunks", "lmcache_p2p_index_nodes",
    "lmcache_p2p_publish_lag_seconds", "lmcache_p2p_lease_up", "lmcache_p2p_peer_errors_total",
    "lmcache_p2p_checksum_failures_total", "lmcache_p2p_handoff_chunks_total", "lmcache_p2p_handoff_bytes_total",
}


def load_dashboard() -> Doc:
    return json.loads((K8S / "grafana-dashboard.json").read_text())


def test_dashboard_queries_only_real_metrics_and_labels():
    assert dashboard_problems(load_dashboard()) == []


def test_dashboard_covers_the_mesh():
    dash = load_dashboard()
    exprs = " ".join(t["expr"] for p in panels(dash) for t in p.get("targets", []))
    assert REQUIRED_METRICS <= set(re.findall(r"\blmcache_p2p_\w+", exprs))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    assert "by (source)" in exprs and "by (transport" in exprs and "by (tier)" in exprs
    # kubectl apply stores the whole object in an annotation limited to 256 KiB.
    assert (K8S / "grafana-dashboard.json").stat().st_size < 200 * 1024


# --------------------------------------------------------------------------- the checks catch mistakes

# --------------------------------------------------------------------------- who reaches the agents

MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
NAMESPACE = {"kubernetes.io/metadata.name": "lmcache-p2p"}


def admits(docs: list[Doc], pod: Doc, port: int, source: dict[str, str], source_ns: dict[str, str]) -> bool:
    """NetworkPolicy ingress semantics for ``pod`` (a workload's template) on ``port`` from a pod labelled
    ``source`` in a namespace labelled ``source_ns``: open unless some policy selects the pod, then open
    only where a rule of one of those policies admits the source and the port."""
    pod_labels = pod["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in of_kind(docs, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and all(pod_labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())]
    if not policies:
        return True

    def peer_admits(peer: Doc) -> bool:
        ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
        ns_ok = (source_ns == NAMESPACE) if ns_sel is None else all(
            source_ns.get(k) == v for k, v in ns_sel.get("matchLabels", {}).items())
        pod_ok = pod_sel is None or all(source.get(k) == v for k, v in pod_sel.get("matchLabels", {}).items())
        return ns_ok and pod_ok

    def port_admits(rule: Doc) -> bool:
        return "ports" not in rule or any(container_port(pod, p["port"]) == port or p["port"] == port
                                          for p in rule["ports"])

    return any((not rule.get("from") or any(peer_admits(f) for f in rule["from"])) and port_admits(rule)
               for policy in policies for rule in policy["spec"].get("ingress", []))


def network_problems(docs: list[Doc], cfg: AgentConfig) -> list[str]:
    """The agents' HTTP port binds the pod IP and a NetworkPolicy lets in whom the README says: transfers
    (and any UCX port) from agent pods only; the HTTP port from agent pods, the router and Prometheus's
    namespace; the OpenAI API from anywhere."""
    out = []
    router = one(docs, "Deployment", "lmcache-router")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app": "something-else"}
    for w, c in agent_containers(docs):
        name = w["metadata"]["name"]
        host = env_of(c).get(ENV_PREFIX + "METRICS_HOST", {}).get("valueFrom", {}).get("fieldRef", {})
        if host.get("fieldPath") != "status.podIP":
            out.append(f"{name}: the HTTP port does not bind the pod IP ({ENV_PREFIX}METRICS_HOST)")
        agent = w["spec"]["template"]["metadata"]["labels"]
        metrics = [p["containerPort"] for p in c.get("ports", []) if p["name"].startswith("metrics")]
        transfer = [p["containerPort"] for p in c.get("ports", []) if p["name"].startswith("transfer")]
        want = [(port, src, ns, ok) for port in metrics for src, ns, ok in (
            (agent, NAMESPACE, True), (router, NAMESPACE, True), ({}, MONITORING_NS, True),
            (stranger, NAMESPACE, False), (router, {"x": "y"}, False))]  # a pod labelled like the router elsewhere
        want += [(port, src, ns, ok) for port in [*transfer, 40123] for src, ns, ok in (  # 40123: a port UCX opened
            (agent, NAMESPACE, True), (router, NAMESPACE, False), ({}, MONITORING_NS, False),
            (stranger, NAMESPACE, False))]
        if any(p["containerPort"] == 8000 for p in c.get("ports", [])):
            want += [(8000, src, ns, True)
                     for src, ns in ((stranger, NAMESPACE), ({}, {"x": "y"}), (router, NAMESPACE))]
        out += [f"{name}: port {port} from {src or 'any pod'} in {ns}: {'refused' if ok else 'admitted'}"
                for port, src, ns, ok in want if admits(docs, w, port, src, ns) != ok]
        if cfg.metrics_port not in metrics:
            out.append(f"{name}: no container port for metrics_port {cfg.metrics_port}")
    return out


def test_agents_http_port_binds_the_pod_ip_and_the_network_policy_admits_only_its_users(tmp_path):
    cfg = config_of(DOCS, tmp_path)
    assert network_problems(DOCS, cfg) == []
    assert config_of(DOCS, tmp_path, env={ENV_PREFIX + "METRICS_HOST": "10.1.2.3"}).metrics_host == "10.1.2.3"


def test_checks_catch_mismatches(tmp_path):
    docs = DOCS
    cfg = config_of(docs, tmp_path)

    def broken(mutate: Any) -> list[Doc]:
        bad = copy.deepcopy(docs)
        mutate(bad)
        return bad

    def set_cm_port(bad: list[Doc]) -> None:
        cm = one(bad, "ConfigMap", CONFIG_MAP)
        cm["data"][CONFIG_KEY] = cm["data"][CONFIG_KEY].replace("port: 7470", "port: 7471")

    bad = broken(set_cm_port)
    assert port_problems(bad, config_of(bad, tmp_path))
    bad = broken(lambda b: one(b, "ServiceMonitor", "lmcache-agent")["spec"]["endpoints"][0].update(port="prom"))
    assert port_problems(bad, cfg)
    bad = broken(lambda b: one(b, "Service", "lmcache-agent-metrics")["spec"]["selector"].update(x="y"))
    assert port_problems(bad, cfg)
    bad = broken(lambda b: agent_containers(b)[0][1]["env"].append({"name": "LMCACHE_P2P_TRANSFER_HOST",
                                                                     "value": "0.0.0.0"}))
    assert env_problems(bad, tmp_path)
    bad = broken(lambda b: one(b, "StatefulSet", "lmcache-etcd")["spec"].update(replicas=5))
    assert etcd_problems(bad, cfg)
    bad = broken(lambda b: one(b, "Service", "lmcache-etcd")["spec"]["ports"][0].update(port=2479))
    assert etcd_problems(bad, cfg)
    bad = broken(lambda b: one(b, "StatefulSet", "lmcache-etcd")["spec"]["template"]["spec"]["containers"][0][
        "args"].remove("--client-cert-auth"))
    assert tls_problems(bad, cfg) == ["etcd runs without --client-cert-auth"]
    for volume in ("etcd-tls", "transfer-tls"):
        bad = broken(lambda b, v=volume: agent_containers(b)[0][1].update(volumeMounts=[
            m for m in agent_containers(b)[0][1]["volumeMounts"] if m["name"] != v]))
        assert len(tls_problems(bad, cfg)) == 3, volume  # every certificate file of that mount

    def mount_every_key(b: list[Doc]) -> None:
        agent_containers(b)[0][1]["volumeMounts"].append({"name": "transfer-tls-all", "mountPath": "/all"})

    assert [p for p in tls_problems(broken(mount_every_key), cfg) if "every pod's transfer key" in p]
    bad = broken(lambda b: one(b, "StatefulSet", "lmcache-vllm")["spec"].update(replicas=3))
    assert tls_problems(bad, cfg) == ["lmcache-vllm: Secret lmcache-p2p-transfer-tls has no "
                                      "['lmcache-vllm-2.crt', 'lmcache-vllm-2.key'] (one certificate per pod)"] * 3
    bad = broken(lambda b: b.append({"kind": "Secret", "metadata": {"name": "lmcache-p2p-etcd-client"},
                                     "data": {"transfer.key": ""}}))
    assert len([p for p in tls_problems(bad, cfg) if "shares Secret" in p]) == len(agent_containers(docs))
    bad = broken(lambda b: one(b, "StatefulSet", "lmcache-etcd")["spec"]["template"]["spec"]["volumes"].clear())
    assert len(tls_problems(bad, cfg)) == len(ETCD_TLS_FLAGS)
    vllm = one(docs, "StatefulSet", "lmcache-vllm")["spec"]["template"]["spec"]["containers"][0]["name"]

    def drop_rank_port(b: list[Doc]) -> None:
        c = one(b, "StatefulSet", "lmcache-vllm")["spec"]["template"]["spec"]["containers"][0]
        c["ports"] = [p for p in c["ports"] if p["name"] != "metrics-r1"]

    assert vllm and len(rank_problems(broken(drop_rank_port), cfg)) == 2  # the port, and its scrape
    bad = broken(lambda b: one(b, "ServiceMonitor", "lmcache-agent-ranks")["spec"]["endpoints"].clear())
    assert rank_problems(bad, cfg) == ["lmcache-vllm: rank 1's metrics are scraped by no ServiceMonitor"]
    router_volumes = ["spec", "template", "spec", "volumes"]

    def router_mounts_agent_key(b: list[Doc]) -> None:
        vols = one(b, "Deployment", "lmcache-router")
        for k in router_volumes:
            vols = vols[k]
        next(v for v in vols if v["name"] == "etcd-tls")["secret"]["secretName"] = "lmcache-p2p-etcd-client"

    assert len(etcd_auth_problems(broken(router_mounts_agent_key), cfg, tmp_path)) == 4  # the mount, 3 files
    bad = broken(lambda b: agent_containers(b)[0][0]["spec"]["template"]["spec"]["volumes"].append(
        {"name": "root", "secret": {"secretName": ROOT_SECRET}}) or agent_containers(b)[0][1]["volumeMounts"].append(
        {"name": "root", "mountPath": "/root-tls"}))
    assert len(etcd_auth_problems(bad, cfg, tmp_path)) == 2  # mounts root's key; and a Secret not its own
    bad = broken(lambda b: one(b, "Job", AUTH_JOB)["spec"]["template"]["spec"]["containers"][0]["env"][0].update(
        value="staging"))
    assert etcd_auth_problems(bad, cfg, tmp_path) == ["Job lmcache-etcd-auth sets up cluster 'staging', the agents' "
                                                      "is 'prod'"]
    bad = broken(lambda b: one(b, "Deployment", "lmcache-router")["spec"]["template"]["spec"][
        "securityContext"].pop("fsGroup"))
    assert len(readable_secret_problems(bad)) == 1
    dash = load_dashboard()
    dash["panels"][1]["targets"][0]["expr"] = "sum by (tier_name) (rate(lmcache_p2p_hits_total[5m]))"
    assert len(dashboard_problems(dash)) == 2
    renamed = broken(lambda b: one(b, "Service", "lmcache-agent-transfer")["metadata"].update(
        name="lmcache-p2p-transfer"))
    with pytest.raises(ValueError):
        config_of(renamed, tmp_path, env=service_link_env(renamed))
    w, c = agent_containers(docs)[0]
    assert mounted_config_path_problems(w, c, "/etc/lmcache-p2p/other.yaml")
    no_policy = broken(lambda b: b.remove(one(b, "NetworkPolicy", "lmcache-agents")))
    assert {p.split(":")[0] for p in network_problems(no_policy, cfg)
            if "port 7470 from {'app': 'something-else'}" in p and p.endswith("admitted")} == \
        {w["metadata"]["name"] for w, _ in agent_containers(docs)}
    open_metrics = broken(lambda b: one(b, "NetworkPolicy", "lmcache-agents")["spec"]["ingress"][1].pop("from"))
    assert [p for p in network_problems(open_metrics, cfg) if "9470 from {'app': 'something-else'}" in p]
    wildcard = broken(lambda b: env_of(agent_containers(b)[0][1]).pop(ENV_PREFIX + "METRICS_HOST") and
                      agent_containers(b)[0][1].update(env=[e for e in agent_containers(b)[0][1]["env"]
                                                            if e["name"] != ENV_PREFIX + "METRICS_HOST"]))
    assert [p for p in network_problems(wildcard, cfg) if "does not bind the pod IP" in p]
    assert servicemonitor_problems({"apiVersion": "v1", "metadata": {"name": "X"}, "spec": {}})
