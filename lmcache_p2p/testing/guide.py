"""A docs page's shell blocks run as a reader runs them: one terminal per machine, each machine a network
namespace holding the page's literal address (``tests/test_vllm_two_nodes_guide.py``).

    blocks = shell_blocks(Path("docs/getting-started/two-nodes.md"))   # [Block("A", "mkdir ..."), ...]
    with MachinePair({"A": "10.0.0.1", "B": "10.0.0.2"}) as machines:
        a = machines.terminal("A", env=env)
        print(a.run(blocks[0].code, timeout=60))

A block is a fenced block whose info string is ``bash node=<name>``; other blocks are prose to the test.
The two machines are namespaces joined by one veth pair in a /24 of their own: nothing in this (the
root) namespace routes to them, so the page's addresses never collide with the host's, nor with
:mod:`.netlab`'s labs running beside (names here never start with ``lp``). A terminal is one
``bash`` per machine reading the blocks on stdin under ``set -eo pipefail``, as one shell window: what a
block exports stays for the next one; a command that fails ends the terminal and :meth:`Terminal.run`
raises with what it printed. ``close()`` (also at interpreter exit) kills every process left in the
namespaces (the background jobs the page starts) and removes them. Needs root and ``ip``
(:func:`.netlab.available`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import queue
import random
import re
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from .netlab import NetLabError, available

_BLOCK = re.compile(r"^```bash node=(\w+)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_DONE = "__guide_block_done__"


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    node: str
    code: str


def shell_blocks(page: Path) -> list[Block]:
    """The page's ``bash node=<name>`` blocks, in page order."""
    return [Block(m.group(1), m.group(2)) for m in _BLOCK.finditer(page.read_text())]


class BlockFailed(RuntimeError):
    pass


def _ip(*argv: str, check: bool = True) -> str:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetLabError(f"ip {' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


class Terminal:
    """One shell on one machine: blocks run one after another in it, its state carried between them."""

    def __init__(self, name: str, argv: list[str], cwd: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.transcript: list[str] = []  # every line it printed
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._proc = subprocess.Popen([*argv, "bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=dict(env),
                                      text=True, start_new_session=True)
        threading.Thread(target=self._read, name=f"terminal-{name}", daemon=True).start()
        self._send("set -eo pipefail\n")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _send(self, text: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(text)
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            raise BlockFailed(f"the terminal on {self.name} has ended (exit {self._proc.poll()})") from exc

    def run(self, code: str, timeout: float) -> str:
        """Run ``code`` as typed into the terminal; what it printed. :class:`BlockFailed` when a command
        failed (the terminal ends, as ``set -e`` does) or the block did not finish within ``timeout``."""
        self._send(code.rstrip("\n") + f"\necho {_DONE}\n")
        out: list[str] = []
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                try:
                    line = self._lines.get(timeout=0.5)
                except queue.Empty:
                    continue
                if line is None:
                    self._proc.wait(10)
                    raise BlockFailed(f"on {self.name}, exit {self._proc.returncode}:\n{code}\n--- printed:\n"
                                      + "\n".join(out))
                if line == _DONE:
                    return "\n".join(out)
                out.append(line)
                self.transcript.append(line)
        finally:
            timer.cancel()
        raise BlockFailed(f"on {self.name}, not done within {timeout:.0f}s:\n{code}\n--- printed:\n" + "\n".join(out))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class MachinePair:
    """Two network namespaces joined by a veth pair: ``{name: address}``, both in one /24."""

    def __init__(self, addresses: Mapping[str, str], prefix_len: int = 24) -> None:
        why = available()
        if why is not None:
            raise NetLabError(f"network namespaces unavailable: {why}")
        if len(addresses) != 2:
            raise ValueError(f"addresses: a pair of machines, got {len(addresses)}")
        run_id = f"{os.getpid() % 10000:04d}{random.randint(0, 0xFFF):03x}"
        self.namespaces = {name: f"gd{run_id}{name}" for name in addresses}
        self.addresses = dict(addresses)
        self._terminals: list[Terminal] = []
        self._closed = False
        atexit.register(self.close)
        try:
            (a, ns_a), (b, ns_b) = self.namespaces.items()
            for ns in (ns_a, ns_b):
                _ip("netns", "add", ns)
            _ip("link", "add", ns_a, "type", "veth", "peer", "name", ns_b)  # each end named after its namespace
            for name, ns in self.namespaces.items():
                _ip("link", "set", ns, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/{prefix_len}", "dev", ns)
                _ip("-n", ns, "link", "set", ns, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def terminal(self, name: str, cwd: Path, env: Mapping[str, str]) -> Terminal:
        term = Terminal(name, ["ip", "netns", "exec", self.namespaces[name]], cwd, env)
        self._terminals.append(term)
        return term

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for term in self._terminals:
            term.close()
        for ns in self.namespaces.values():
            for pid in _ip("netns", "pids", ns, check=False).split():  # the page's background jobs
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)  # its veth end goes with it, and the pair with that
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """This pair's namespaces still present (empty after ``close()``)."""
        names = {line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.strip()}
        return sorted(names & set(self.namespaces.values()))

    def __enter__(self) -> MachinePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
