"""The operators' kit in k8s/ and docker/ checked against the code: alert rules, dashboard, images, docs.

- ``k8s/alerts.yaml`` is a PrometheusRule whose rule groups pass ``promtool check rules``, and whose
  firing logic passes ``promtool test rules`` on synthetic series (a hit-rate drop against a day and
  an hour earlier, a lease down, a router without engines, MAC failures).
- Every metric the alerts and the dashboard query is one that something exposes: the agent's and the
  router's registries, built here in-process (a rename in the code fails this test), or an explicit
  allowlist of vLLM's, etcd's and Prometheus' own names, each checked where it comes from (vLLM's
  source, a real etcd's ``/metrics``). Labels in matchers and groupings are labels of those metrics or
  of the scrape targets; a label value matched with ``=`` is one the code writes.
- Every alert's ``runbook_url`` is docs/operations/troubleshooting.md at a heading named for the alert.
- k8s/README.md names only resources that exist with that kind, the kustomization lists files that
  exist, and the TP claim in the manifests is what ``Fingerprint.of`` does.
- The Dockerfiles copy no secret, install extras that exist and run real CLI commands.

promtool comes from Debian's ``prometheus`` package (``scripts/setup.sh`` installs it); without it the
promtool tests fail, saying so: the alert rules are checked wherever the suite runs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.cli import COMMANDS
from lmcache_p2p.config import load_config
from lmcache_p2p.integrations.kv_order import DEFAULT_ORDER, LEGACY_ORDERS, layout_order
from lmcache_p2p.keys import Fingerprint, is_head_major
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.metrics_http import scrape
from lmcache_p2p.router.metrics import Metrics as RouterMetrics

ROOT = Path(__file__).resolve().parents[1]
K8S, DOCKER = ROOT / "k8s", ROOT / "docker"
Doc = dict[str, Any]
RUNBOOK = "docs/operations/troubleshooting.md"  # every alert's runbook_url: this page at the alert's heading
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.usefixtures("promtool_installed")


@pytest.fixture
def promtool_installed() -> None:
    if PROMTOOL is None:
        pytest.fail("promtool not installed: scripts/setup.sh installs it (Debian's prometheus package)")

# Labels Prometheus (through the Operator's ServiceMonitors) puts on every scraped series.
TARGET_LABELS = frozenset({"namespace", "pod", "instance", "job", "service", "endpoint", "container"})
# Metrics the project does not define, by where they come from: each is checked against its source below.
VLLM_METRICS = {"vllm:time_to_first_token_seconds_bucket": frozenset({"model_name", "engine", "le"})}
ETCD_METRICS = {name: frozenset() for name in (
    "etcd_server_has_leader", "etcd_server_leader_changes_seen_total", "etcd_mvcc_db_total_size_in_bytes",
    "etcd_server_quota_backend_bytes")}
PROMETHEUS_METRICS = {"up": frozenset()}  # Prometheus' own per-target series
ALLOWED = {**VLLM_METRICS, **ETCD_METRICS, **PROMETHEUS_METRICS}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("", "_sum", "_count", "_created")}


# --------------------------------------------------------------------------- what the code exposes

def _wrapped(objects: Iterable[object]) -> Iterator[MetricWrapperBase]:
    for obj in objects:
        yield from (v for v in vars(obj).values() if isinstance(v, MetricWrapperBase))


def _series(registry: CollectorRegistry, collectors: Iterable[MetricWrapperBase],
            custom: dict[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    """Series name -> label names, for every family in ``registry`` (each must be accounted for)."""
    labels = {fam.name: frozenset(c._labelnames) for c in collectors for fam in c.describe()}
    labels.update({name: frozenset(names) for name, names in custom.items()})
    out: dict[str, frozenset[str]] = {}
    for fam in registry.collect():
        assert fam.name in labels, f"{fam.name}: a collector this test does not know; add it"
        out.update({fam.name + s: labels[fam.name] | ({"le"} if s == "_bucket" else set())
                    for s in SUFFIXES[fam.type]})
    return out


@pytest.fixture(scope="module")
def exposed() -> dict[str, frozenset[str]]:
    return exposed_series()


@functools.cache
def exposed_series() -> dict[str, frozenset[str]]:
    """Every series name a real agent (its AgentMetrics and the registry's other collectors, such as the
    invalidation counter) and the router expose, with their label names."""
    config = load_config(env={}, overrides={"node_id": "ops"})
    registry = CollectorRegistry()
    agent = CacheAgent(config, Fingerprint.of(config.layout), 4096, metrics=AgentMetrics(registry),
                       secret=b"s" * 32)
    try:
        out = _series(registry, _wrapped([agent.metrics, agent.invalidation]), agent.metrics.live_counters())
    finally:
        agent.stop()
    router = RouterMetrics()
    out.update(_series(router.registry, _wrapped([router]), {}))
    return out


# --------------------------------------------------------------------------- reading PromQL

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                      "offset", "bool", "inf", "nan"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, aggregations and keywords left out)."""
    e = _STRING.sub('""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = _GROUPING.sub(" ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\s*(\()?", e):
        if m.group(2) is None and m.group(1) not in KEYWORDS:
            names.add(m.group(1))
    return names


def matchers(expr: str) -> Iterator[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in ``expr``."""
    for sel in re.finditer(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr):
        for m in re.finditer(r"(\w+)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"", sel.group(2)):
            yield sel.group(1), m.group(1), m.group(2), m.group(3)


def string_literals() -> set[str]:
    """Every double-quoted string literal in the package's source: the label values the code can write."""
    out: set[str] = set()
    for path in (ROOT / "lmcache_p2p").rglob("*.py"):
        out.update(re.findall(r'"([a-z_]+)"', path.read_text()))
    return out


def expr_problems(where: str, expr: str, series: dict[str, frozenset[str]], literals: set[str]) -> list[str]:
    known = {**series, **ALLOWED}
    used = metric_names(expr)
    problems = [f"{where}: unknown metric {m}" for m in sorted(used - set(known))]
    allowed = TARGET_LABELS.union(*(known.get(m, frozenset()) for m in used))
    labels = set()
    for group in _GROUPING.findall(expr):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    for metric, label, op, value in matchers(expr):
        labels.add(label)
        if op in ("=", "!=") and metric in series and label not in TARGET_LABELS and value not in literals:
            problems.append(f"{where}: {metric}{{{label}{op}\"{value}\"}}: no such value in the code")
    problems += [f"{where}: label {lb} is on none of {sorted(used)}" for lb in sorted(labels - allowed)]
    return problems


# --------------------------------------------------------------------------- the alert rules

def load_rule() -> Doc:
    return yaml.safe_load((K8S / "alerts.yaml").read_text())


def rules(doc: Doc) -> Iterator[Doc]:
    for group in doc["spec"]["groups"]:
        yield from group["rules"]


def rule_problems(doc: Doc) -> list[str]:
    """The PrometheusRule's shape, as the Operator and Alertmanager receivers need it."""
    problems = []
    if doc.get("apiVersion") != "monitoring.coreos.com/v1" or doc.get("kind") != "PrometheusRule":
        problems.append(f"{doc.get('apiVersion')} {doc.get('kind')}: not a PrometheusRule")
    if set(doc.get("spec", {})) != {"groups"}:
        problems.append("spec must hold groups only")
    names = [g["name"] for g in doc["spec"]["groups"]]
    if len(names) != len(set(names)):
        problems.append("group names are not unique")
    alerts = [r["alert"] for r in rules(doc) if "alert" in r]
    if len(alerts) != len(set(alerts)):
        problems.append("alert names are not unique")
    for r in rules(doc):
        name = r.get("alert", r.get("record"))
        unknown = set(r) - {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
        if unknown:
            problems.append(f"{name}: unknown fields {sorted(unknown)}")
        if "alert" not in r:
            continue
        if r.get("labels", {}).get("severity") not in ("critical", "warning"):
            problems.append(f"{name}: severity must be critical or warning")
        notes = r.get("annotations", {})
        for key in ("summary", "description", "hint"):
            if not str(notes.get(key, "")).strip():
                problems.append(f"{name}: no {key}")
        if notes.get("runbook_url") != f"{RUNBOOK}#{name.lower()}":
            problems.append(f"{name}: runbook_url is not {RUNBOOK}#{name.lower()}")
    return problems


def test_alert_rules_are_a_well_formed_prometheus_rule():
    doc = load_rule()
    assert rule_problems(doc) == []
    bad = copy.deepcopy(doc)
    first = next(rules(bad))
    del first["annotations"]["summary"]
    first["labels"]["severity"] = "page"
    assert len(rule_problems(bad)) == 2


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, spaces to hyphens, punctuation dropped."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#{1,6} (.+)$", markdown, flags=re.M)}


def test_every_alert_has_its_heading_in_the_runbook():
    anchors = heading_anchors((ROOT / RUNBOOK).read_text())
    assert "the-hit-rate-is-low-a-decision-tree" in anchors  # the slug rule, on a heading with punctuation
    missing = [r["alert"] for r in rules(load_rule()) if "alert" in r and r["alert"].lower() not in anchors]
    assert missing == [], f"alerts without a heading in {RUNBOOK}: {missing}"
    assert heading_anchors("## Alerts\n### LMCacheP2PLeaseDown\n") == {"alerts", "lmcachep2pleasedown"}


def test_the_alerts_cover_what_operators_page_on():
    exprs = {r["alert"]: r["expr"] for r in rules(load_rule())}
    text = " ".join(exprs.values())
    for metric in ("lmcache_p2p_lease_up", "lmcache_p2p_degraded", "lmcache_p2p_checksum_failures_total",
                   "lmcache_p2p_publish_lag_seconds", "lmcache_p2p_lease_losses_total",
                   "lmcache_p2p_etcd_faults_total", "etcd_mvcc_db_total_size_in_bytes",
                   "lmcache_p2p_load_failures_total", "lmcache_p2p_peers_backed_off",
                   "lmcache_p2p_router_engines", "lmcache_p2p_object_uploads_dropped_total",
                   "lmcache_p2p_canary_checks_total", "lmcache_p2p_invalidated_chunks_total"):
        assert metric in text, metric
    assert 'outcome="mac"' in text
    drops = [e for e in exprs.values() if "lmcache_p2p_hit_tokens_total" in e]
    assert {"offset 1d", "offset 1h"} <= {o for e in drops for o in re.findall(r"offset \d+[hd]", e)}


def test_alerts_query_only_exposed_metrics_and_labels(exposed):
    literals = string_literals()
    problems = [p for r in rules(load_rule()) for p in expr_problems(r["alert"], r["expr"], exposed, literals)]
    assert problems == []


def test_a_renamed_metric_or_label_value_is_caught(exposed):
    literals = string_literals()
    for rule in rules(load_rule()):
        assert metric_names(rule["expr"]), rule["alert"]
    renamed = {k.replace("lease_up", "lease_alive"): v for k, v in exposed.items()}
    expr = next(r["expr"] for r in rules(load_rule()) if r["alert"] == "LMCacheP2PLeaseDown")
    assert expr_problems("x", expr, renamed, literals) == ["x: unknown metric lmcache_p2p_lease_up"]
    bad = 'sum by (peer) (increase(lmcache_p2p_pull_chunks_total{outcome="hmac"}[5m]))'
    assert len(expr_problems("x", bad, exposed, literals)) == 2  # no such value; peer is not its label
    assert metric_names('sum by (le) (rate(vllm:x_bucket{a="b"}[5m] offset 1d)) / on (pod) up') == {
        "vllm:x_bucket", "up"}


def rules_file(tmp_path: Path, doc: Doc, annotations: bool = True) -> Path:
    spec = copy.deepcopy(doc["spec"])
    if not annotations:
        for group in spec["groups"]:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rule_groups(tmp_path):
    doc = load_rule()
    done = promtool("check", "rules", rules_file(tmp_path, doc))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    assert f"{sum(1 for _ in rules(doc))} rules found" in done.stdout
    next(rules(doc))["expr"] += " >"  # a broken expression is refused
    assert promtool("check", "rules", rules_file(tmp_path, doc)).returncode != 0


STEP_MIN = 5  # the hit-rate tests' sample interval: 25 hours of series in 301 samples


def counter(segments: list[tuple[int, int]]) -> str:
    """promtool series values: a counter over consecutive samples, ``(samples, increase per sample)``."""
    out, value = [], 0
    for samples, step in segments:
        out.append(f"{value}+{step}x{samples - 1}")
        value += step * samples
    return " ".join(out)


def hit_series(ratios: list[tuple[int, float]]) -> list[Doc]:
    """Hit and miss token counters of one pod, 1,000 prompt tokens a minute: ``(minutes, hit ratio)``."""
    labels, per = 'namespace="ns", pod="a"', 1000 * STEP_MIN
    return [{"series": f'lmcache_p2p_hit_tokens_total{{{labels}, source="peer", tier="cpu"}}',
             "values": counter([(m // STEP_MIN, round(per * r)) for m, r in ratios])},
            {"series": f"lmcache_p2p_miss_tokens_total{{{labels}}}",
             "values": counter([(m // STEP_MIN, per - round(per * r)) for m, r in ratios])}]


def fired(name: str, at: str, labels: dict[str, str], severity: str = "warning") -> Doc:
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": {**labels, "severity": severity}}]}


def quiet(name: str, at: str) -> Doc:
    return {"eval_time": at, "alertname": name, "exp_alerts": []}


def promtool_test(tmp_path: Path, evaluation_interval: str, tests: list[Doc]) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of ``tests`` against the alerts (annotations left out: the firing logic)."""
    rules_path = rules_file(tmp_path, load_rule(), annotations=False)
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules_path.name], "evaluation_interval": evaluation_interval,
                                    "tests": tests}))
    return promtool("test", "rules", spec)


@needs_promtool
def test_promtool_hit_rate_drops_against_their_own_past(tmp_path):
    ns, every = {"namespace": "ns"}, f"{STEP_MIN}m"
    tests = [
        {   # 20 % an hour into yesterday, 90 % all day, 15 % now: a fall against the hour before, not
            # against the same time yesterday (that was low too)
            "interval": every, "input_series": hit_series([(60, 0.2), (1380, 0.9), (65, 0.15)]),
            "alert_rule_test": [fired("LMCacheP2PHitRateDropVsHourAgo", "1500m", ns),
                                quiet("LMCacheP2PHitRateDropVsYesterday", "1500m"),
                                quiet("LMCacheP2PHitRateDropVsHourAgo", "1440m")]},
        {   # 90 % for a day, then 15 %: under half of both
            "interval": every, "input_series": hit_series([(1440, 0.9), (65, 0.15)]),
            "alert_rule_test": [fired("LMCacheP2PHitRateDropVsYesterday", "1500m", ns),
                                fired("LMCacheP2PHitRateDropVsHourAgo", "1500m", ns)]},
        {   # a steady 40 %: no drop, whatever its level
            "interval": every, "input_series": hit_series([(1505, 0.4)]),
            "alert_rule_test": [quiet("LMCacheP2PHitRateDropVsYesterday", "1500m"),
                                quiet("LMCacheP2PHitRateDropVsHourAgo", "1500m")]},
    ]
    done = promtool_test(tmp_path, every, tests)
    assert done.returncode == 0, done.stdout + done.stderr
    # The tests can fail: the yesterday alert expected where it must stay quiet.
    tests[0]["alert_rule_test"][1] = fired("LMCacheP2PHitRateDropVsYesterday", "1500m", ns)
    assert promtool_test(tmp_path, every, tests).returncode != 0


@needs_promtool
def test_promtool_lease_router_and_mac_alerts(tmp_path):
    ns = {"namespace": "ns"}
    series = {
        'lmcache_p2p_lease_up{namespace="ns", pod="a"}': "1 1 0x10",
        'lmcache_p2p_lease_up{namespace="ns", pod="b"}': "1x12",
        'lmcache_p2p_router_engines{namespace="ns", pod="r", state="healthy"}': "2 2 0x10",
        'lmcache_p2p_router_engines{namespace="ns", pod="r", state="unhealthy"}': "0 0 2x10",
        'lmcache_p2p_pull_chunks_total{namespace="ns", pod="a", transport="tcp", outcome="mac"}': "0 0 0 1x10",
        'lmcache_p2p_pull_chunks_total{namespace="ns", pod="b", transport="tcp", outcome="loaded"}': "0+5x12",
    }
    tests = [{"interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
              "alert_rule_test": [
                  quiet("LMCacheP2PLeaseDown", "2m"),  # down, but not for a minute yet
                  fired("LMCacheP2PLeaseDown", "5m", {**ns, "pod": "a"}, "critical"),
                  quiet("LMCacheP2PRouterNoHealthyEngine", "3m"),
                  fired("LMCacheP2PRouterNoHealthyEngine", "6m", {**ns, "pod": "r"}, "critical"),
                  quiet("LMCacheP2PMacFailures", "2m"),
                  fired("LMCacheP2PMacFailures", "5m", {**ns, "pod": "a"}, "critical")]}]
    done = promtool_test(tmp_path, "1m", tests)
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- the allowlist, at its sources

def test_allowed_vllm_metrics_are_vllms():
    spec = importlib.util.find_spec("vllm")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm not installed")
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py").read_text()
    for name in VLLM_METRICS:
        family = name.removesuffix("_bucket")
        assert f'name="{family}"' in source, f"{family} is not a vLLM metric"
        block = source[source.index(f'name="{family}"'):][:400]
        assert "labelnames=labelnames" in block  # (model_name, engine): VLLM_METRICS' labels


def test_allowed_etcd_metrics_are_etcds(etcd):
    exposed_by_etcd = {re.sub(r"\{.*", "", name) for name in scrape(etcd.endpoint.rstrip("/") + "/metrics")}
    assert set(ETCD_METRICS) <= exposed_by_etcd, set(ETCD_METRICS) - exposed_by_etcd


# --------------------------------------------------------------------------- the dashboard

def dashboard_exprs() -> Iterator[tuple[str, str]]:
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    for p in dash["panels"]:
        for q in [p, *p.get("panels", [])]:
            for t in q.get("targets", []):
                yield q["title"], t["expr"]


def test_dashboard_queries_only_exposed_metrics_and_labels(exposed):
    literals = string_literals()
    problems = [p for title, expr in dashboard_exprs() for p in expr_problems(title, expr, exposed, literals)]
    assert problems == []


def test_dashboard_has_the_ops_panels():
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    ids = [q["id"] for p in dash["panels"] for q in [p, *p.get("panels", [])]]
    assert len(ids) == len(set(ids))
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs()))
    for metric in ("lmcache_p2p_router_requests_total", "lmcache_p2p_router_engines",
                   "lmcache_p2p_router_engines_refused_total", "lmcache_p2p_canary_checks_total",
                   "lmcache_p2p_blend_requests_total", "lmcache_p2p_pull_expected_seconds",
                   "lmcache_p2p_recompute_chunk_seconds", "lmcache_p2p_fetch_decisions_total",
                   "vllm:time_to_first_token_seconds_bucket", "lmcache_p2p_router_first_byte_seconds_bucket"):
        assert metric in used, metric
    ttft = {t for t, e in dashboard_exprs() if "vllm:time_to_first_token_seconds_bucket" in e}
    beside = {t for t, e in dashboard_exprs() if "lmcache_p2p_router_first_byte_seconds_bucket" in e}
    assert len(ttft) == 1 and ttft <= beside  # vLLM's TTFT beside the router's first byte, in one panel


# --------------------------------------------------------------------------- manifests and docs

def manifests() -> list[tuple[str, Doc]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def resource_names() -> set[tuple[str, str]]:
    """(kind, name) of every resource the kustomization makes: the manifests and its generators."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = {(d["kind"], d["metadata"]["name"]) for _, d in manifests()}
    out |= {("Secret", g["name"]) for g in kust.get("secretGenerator", [])}
    out |= {("ConfigMap", g["name"]) for g in kust.get("configMapGenerator", [])}
    return out


def test_kustomization_lists_files_that_exist_and_parse():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for name in kust["resources"]:
        docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
        assert docs and all("kind" in d and "metadata" in d for d in docs), name
    assert "alerts.yaml" in kust["resources"] and "servicemonitor.yaml" in kust["resources"]
    for gen in kust.get("configMapGenerator", []):
        for f in gen["files"]:
            assert (K8S / f.split("=")[-1]).is_file(), f


def test_the_router_and_vllm_are_scraped():
    docs = [d for _, d in manifests()]
    services = [d for d in docs if d["kind"] == "Service"]
    for sm_name, svc_name, port in (("lmcache-router", "lmcache-router", "http"), ("lmcache-vllm", "lmcache-vllm",
                                                                                   "http")):
        (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"] == sm_name]
        want = sm["spec"]["selector"]["matchLabels"]
        picked = [s["metadata"]["name"] for s in services
                  if all(s["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
        assert picked == [svc_name], (sm_name, picked)
        assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [(port, "/metrics")]


KINDS = {"statefulset": "StatefulSet", "deployment": "Deployment", "job": "Job", "svc": "Service",
         "service": "Service", "configmap": "ConfigMap", "secret": "Secret"}
_NAMED = re.compile(r"\b(StatefulSet|Deployment|Service|ServiceMonitor|PrometheusRule|ConfigMap|Secret|Job|"
                    r"Namespace|PodDisruptionBudget)s?\s+((?:`[a-z0-9-]+`(?:,\s*|\s+and\s+)?)+)")


def readme_references(text: str) -> list[tuple[str, str]]:
    """(kind, name) a README names: ``kubectl`` kind/name arguments, "Kind `name`" in prose and tables,
    and the kind and name of each YAML block that has both."""
    refs = [(KINDS[k.lower()], n) for k, n in re.findall(r"\b(statefulset|deployment|job|svc)/([a-z0-9-]+)", text)]
    for kind, names in _NAMED.findall(text):
        refs += [(kind, n) for n in re.findall(r"`([a-z0-9-]+)`", names)]
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and "kind" in doc:
            refs.append((doc["kind"], doc["metadata"]["name"]))
    return refs


def test_k8s_readme_names_resources_that_exist():
    text = (K8S / "README.md").read_text()
    refs = readme_references(text)
    assert ("StatefulSet", "lmcache-vllm") in refs and ("Deployment", "lmcache-router") in refs
    assert [r for r in refs if r not in resource_names()] == []
    wrong = text.replace("kind: StatefulSet\nmetadata:\n  name: lmcache-vllm", "kind: Deployment\nmetadata:\n  "
                         "name: lmcache-vllm")
    assert ("Deployment", "lmcache-vllm") in [r for r in readme_references(wrong) if r not in resource_names()]
    for word in ("router", "alerts.yaml", "grafana-dashboard.json", "docker/Dockerfile.vllm-cuda",
                 "docker/Dockerfile.agent", "untested", "ServiceMonitor `lmcache-router`"):
        assert word in text, word


def test_tp2_pods_and_cache_agents_share_a_fingerprint_as_the_manifests_say(tmp_path):
    """vllm.yaml's engines and cache-agent.yaml's agents have equal fingerprints at every rank, because the
    layout the engines name is head-major (keys.Fingerprint.of leaves TP out); with vLLM's default NHD
    they would not."""
    docs = [d for _, d in manifests()]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "lmcache-vllm"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    args = dict(a.split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
    order = env.get("VLLM_KV_CACHE_LAYOUT") or DEFAULT_ORDER
    engine_layout = f"vllm-cuda:{args['--attention-backend']}:{LEGACY_ORDERS.get(order, order)}"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lmcache-p2p-config"]
    (tmp_path / "agent.yaml").write_text(cm["data"]["agent.yaml"])
    layout = load_config(tmp_path / "agent.yaml", env={}).layout
    assert layout.kv_layout == engine_layout and layout_order(engine_layout) == "LBHNC"
    assert is_head_major(engine_layout)
    tp = int(args["--tensor-parallel-size"])
    assert tp == 2 and {Fingerprint.of(layout, tp, r).digest for r in range(tp)} == {Fingerprint.of(layout).digest}
    nhd = dataclasses.replace(layout, kv_layout=engine_layout.replace("LBHNC", LEGACY_ORDERS["NHD"]))
    assert Fingerprint.of(nhd, tp, 0).digest != Fingerprint.of(nhd).digest != Fingerprint.of(nhd, tp, 1).digest


# --------------------------------------------------------------------------- images

def dockerfile(name: str) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / name).read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile.vllm-cuda", "Dockerfile.agent"])
def test_dockerfiles_copy_no_secret_and_install_real_extras(name):
    assert "UNTESTED" in (DOCKER / name).read_text().split("FROM", 1)[0]
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    steps = dockerfile(name)
    for op, arg in steps:
        assert op != "ADD", f"{name}: ADD"
        if op == "COPY":
            *sources, _ = arg.split()
            assert sources and all(s not in (".", "k8s", "k8s/") and (ROOT / s).exists() for s in sources), arg
        if op == "RUN":
            for group in re.findall(r'"\.\[([a-z,]+)\]"', arg):
                assert set(group.split(",")) <= extras, group
        assert not re.search(r"k8s/|cluster-secret|router-key|pki/", arg), arg
        assert op not in ("ENV", "ARG") or not re.search(r"(?i)secret|key|token|password", arg), arg
    ignore = [x for x in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert ignore[0] == "*" and not [x for x in ignore if x.startswith("!") and "k8s" in x]


def test_the_agent_image_runs_real_commands():
    steps = dict(dockerfile("Dockerfile.agent"))
    assert json.loads(steps["ENTRYPOINT"]) == ["lmcache-p2p"]
    assert (json.loads(steps["CMD"])[0],) in COMMANDS and ("router",) in COMMANDS
    images = {d["metadata"]["name"]: {c["image"] for c in d["spec"]["template"]["spec"].get("initContainers", [])
                                      + d["spec"]["template"]["spec"]["containers"]}
              for _, d in manifests() if d["kind"] in ("Deployment", "StatefulSet")}
    assert images["lmcache-router"] == images["lmcache-cache-agent"] == {"lmcache-p2p-agent:latest"}
    assert images["lmcache-vllm"] == {"lmcache-p2p-vllm:latest"}
