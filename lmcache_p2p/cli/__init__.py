"""The ``lmcache-p2p`` command: one module per subcommand here, each with a ``main(argv)`` returning the exit
code; the benchmarks' are in ``lmcache_p2p/bench/`` (one module per bench). Shared argument handling
(etcd endpoints, TLS, auth, the private-etcd fallback; prompt files): ``common.py``.
"""

from __future__ import annotations

import importlib
import sys

from .. import __version__

# command words -> "module:function"; the function takes the remaining argv and returns an exit code.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "tiers"): ("lmcache_p2p.bench.tiers:main", "CPU and disk tiers vs memcpy and raw file I/O"),
    ("bench", "index"): ("lmcache_p2p.bench.index:main", "etcd block index: publish rate, lookup cost, bytes"),
    ("bench", "transfer"): ("lmcache_p2p.bench.transfer:main", "peer pulls over TCP/NIXL vs raw baselines"),
    ("bench", "mesh"): ("lmcache_p2p.bench.mesh:main", "lookup + load of a 128-chunk prompt: peer and local hits"),
    ("bench", "chaos"): ("lmcache_p2p.bench.chaos:main", "4 vLLM nodes (netns) under load and faults"),
    ("bench", "vllm"): ("lmcache_p2p.bench.vllm:main", "TTFT in real vLLM: cold, miss, peer hit, LMCache"),
    ("bench", "route"): ("lmcache_p2p.bench.route:main",
                         "open-loop load through lmcache-p2p router: round-robin, score, score + load, disaggregated"),
    ("bench", "chat"): ("lmcache_p2p.bench.chat:main", "a chat across 2 vLLM engines: reuse, TTFT per turn"),
    ("bench", "blend"): ("lmcache_p2p.bench.blend:main",
                         "RAG documents in another order on 2 vLLM engines: reuse, TTFT, quality"),
    ("bench", "selection"): ("lmcache_p2p.bench.selection:main",
                             "the blend's selections on one engine in-process: graded answers, KL, many prompts"),
    ("bench", "serve"): ("lmcache_p2p.bench.serve:main",
                         "a fleet of vLLM engines under load from vLLM's own client: mesh, vLLM alone, LMCache"),
    ("bench", "scale"): ("lmcache_p2p.bench.scale:main",
                         "the control plane with many simulated agents on a 3-member etcd; 1,000-node extrapolation"),
    ("bench", "tp"): ("lmcache_p2p.bench.tp:main", "TTFT in real vLLM: peer hits between TP=1 and TP=2 engines"),
    ("bench", "objects"): ("lmcache_p2p.bench.objects:main",
                           "the object tier vs the raw S3 client; vLLM TTFT for a hit from the store vs cold"),
    ("bench", "config"): ("lmcache_p2p.bench.config:main", "config set -> applied in running agents vs an etcd watch"),
    ("bench", "step"): ("lmcache_p2p.bench.step:main",
                        "the connector's scheduler side per engine step, by batch size: linear or not"),
    ("bench", "params"): ("lmcache_p2p.bench.params:main",
                          "hostile kv_transfer_params beside a decode stream: the stream's token gaps and TTFT"),
    ("config",): ("lmcache_p2p.cli.config:main", "cluster config in etcd: get | set | watch"),
    ("agent",): ("lmcache_p2p.cli.agent:main", "run a standalone cache agent"),
    ("status",): ("lmcache_p2p.cli.status:main", "cluster status from etcd and agents' metrics"),
    ("invalidate",): ("lmcache_p2p.cli.invalidate:main", "drop chunks mesh-wide: by fingerprint, tenant, node"),
    ("verify",): ("lmcache_p2p.cli.verify:main", "the canary: owners' chunks vs the model's own KV; quarantines"),
    ("lookup",): ("lmcache_p2p.cli.lookup:main", "which chunks of a prompt are held where (--explain: why not)"),
    ("score",): ("lmcache_p2p.cli.score:main", "where a prompt's cache is, per node, from an agent's /v1/score"),
    ("events",): ("lmcache_p2p.cli.events:main", "the mesh index as vLLM KV events (ZMQ PUB) for KV-aware routers"),
    ("router",): ("lmcache_p2p.cli.router:main", "an OpenAI-compatible front routing by cache and load"),
    ("router", "key"): ("lmcache_p2p.cli.router:key_main", "the router key (hex) of the cluster secret, for routers"),
    ("demo",): ("lmcache_p2p.cli.demo:main", "two vLLM nodes share KV cache through the mesh (private etcd)"),
    ("bench", "kernels"): ("lmcache_p2p.bench.kernels:main", "paged-KV gather/scatter vs memcpy"),
    ("identity",): ("lmcache_p2p.cli.identity:main", "a model's identity (layout.model_id) from its files"),
    ("certs",): ("lmcache_p2p.cli.certs:main", "a cluster CA and TLS certificates (transfer, etcd)"),
    ("etcd",): ("lmcache_p2p.cli.etcd:main", "run a private etcd (the embedded default)"),
    ("doctor",): ("lmcache_p2p.cli.doctor:main", "check a node's config and environment: etcd, secret, hosts, peers"),
}

# how the usage groups the commands (a command in no group is listed under "run")
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("operate", ("config", "invalidate", "verify", "certs", "identity")),
    ("inspect", ("status", "doctor", "lookup", "score", "events")),
    ("run", ("agent", "router", "etcd", "demo")),
    ("benchmark", ("bench",)),
)
HELP_WORDS = (["-h"], ["--help"], ["help"])


def _usage() -> str:
    lines = ["usage: lmcache-p2p <command> [args]   (lmcache-p2p <command> --help: its options)",
             "       lmcache-p2p --version"]
    grouped = {word for _, words in GROUPS for word in words}
    for group, words in GROUPS:
        lines += ["", f"{group}:"]
        for cmd, (_, help_) in COMMANDS.items():
            if cmd[0] in words or (group == "run" and cmd[0] not in grouped):
                lines.append(f"  {' '.join(cmd):<18} {help_}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for n in (2, 1):
        target = COMMANDS.get(tuple(args[:n]))
        if target is not None:
            module, func = target[0].split(":")
            return int(getattr(importlib.import_module(module), func)(args[n:]) or 0)
    if args[:1] in (["--version"], ["-V"]):
        print(f"lmcache-p2p {__version__}")
        return 0
    if args[:1] in HELP_WORDS:
        print(_usage())
        return 0
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
