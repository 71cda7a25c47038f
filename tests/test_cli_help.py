"""Every ``lmcache-p2p`` command's help shows its options' defaults (issue 41: "defaults shown")."""

from __future__ import annotations

import argparse
import subprocess
import sys

from lmcache_p2p.usage import HelpFormatter


def test_defaults_are_shown_unless_said_already_or_empty() -> None:
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds to run")
    p.add_argument("--skip", type=int, default=0)  # 0 is a default worth showing (0 == False, but not False)
    p.add_argument("--tokens", type=int, default=None, help="tokens (a prompt of its own)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--etcd", default="x", help="endpoints (default: config/env)")
    p.add_argument("where", nargs="?", default="here")  # positional: its usage says enough
    text = " ".join(p.format_help().split())
    assert "--rounds ROUNDS rounds to run (default: 5)" in text
    assert "--skip SKIP (default: 0)" in text
    assert "tokens (a prompt of its own) --json" in text  # None and a flag off: nothing added
    assert "(default: config/env) " in text + " " and "(default: x)" not in text
    assert "(default: here)" not in text


def test_a_real_command_shows_them() -> None:
    out = subprocess.run([sys.executable, "-m", "lmcache_p2p", "bench", "serve", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--engines ENGINES (default: 3)" in text and "(default: 0.5,1,2)" in text
