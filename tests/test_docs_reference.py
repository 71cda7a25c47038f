"""docs/reference/{configuration,cli,metrics}.md are what ``lmcache_p2p.docsgen`` writes from the code now.

A stale page fails naming the command that regenerates it. The other tests hold the generator to the code
by their own means (dataclass fields, the command table, the Prometheus exposition), so a page can't go
quiet about a field, command or metric and still pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lmcache_p2p import cli, docsgen
from lmcache_p2p.config import AgentConfig
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.router.metrics import Metrics as RouterMetrics

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    docsgen.generate(out)
    return out


@pytest.mark.parametrize("name", sorted(docsgen.PAGES))
def test_committed_page_is_current(generated: Path, name: str) -> None:
    committed = REFERENCE / name
    assert committed.exists(), f"docs/reference/{name} is missing: run `{docsgen.REGENERATE}` and commit it"
    have, want = committed.read_text(), (generated / name).read_text()
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(keepends=True), want.splitlines(keepends=True),
                                            f"committed/{name}", f"generated/{name}", n=1))
        pytest.fail(f"docs/reference/{name} is stale: run `{docsgen.REGENERATE}` and commit the result\n"
                    f"{diff[:6000]}", pytrace=False)


def test_generation_is_deterministic(generated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice in one process, under another terminal width: byte for byte the same pages."""
    monkeypatch.setenv("COLUMNS", "47")
    docsgen.generate(tmp_path)
    for name in docsgen.PAGES:
        assert (tmp_path / name).read_bytes() == (generated / name).read_bytes(), name


def _dotted_fields(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(hints[f.name]):
            out += _dotted_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_config_field_has_a_row(generated: Path) -> None:
    page = (generated / "configuration.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \|", page, flags=re.M)
    assert sorted(rows) == sorted(_dotted_fields(AgentConfig))  # each field once


def test_every_command_has_its_help(generated: Path) -> None:
    page = (generated / "cli.md").read_text()
    headings = re.findall(r"^#{3,} `lmcache-p2p ([^`]+)`", page, flags=re.M)
    subcommands = 0
    for words in cli.COMMANDS:
        assert " ".join(words) in headings, words
        found = docsgen.command_parser(words)
        assert found is not None
        assert f"usage: {found[0].prog} " in page, words
        for action in found[0]._actions:  # argparse subcommands (config get ...) get their own help
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    assert f"{' '.join(words)} {name}" in headings and f"usage: {sub.prog} " in page
                    subcommands += 1
    assert subcommands >= 3  # config get | set | watch


def _exposed(registry: CollectorRegistry) -> list[str]:
    """Metric names as the Prometheus exposition declares them (# TYPE lines; the page notes ``_created``)."""
    names = re.findall(r"^# TYPE (\S+) ", generate_latest(registry).decode(), flags=re.M)
    return [name for name in names if not name.endswith("_created")]


def test_every_metric_is_listed(generated: Path) -> None:
    page = (generated / "metrics.md").read_text()
    agent, router = page.split("\n## Router\n")
    agent_names = _exposed(AgentMetrics(CollectorRegistry()).registry)
    router_names = _exposed(RouterMetrics().registry)
    assert "lmcache_p2p_lookups_total" in agent_names and "lmcache_p2p_router_requests_total" in router_names
    for name in agent_names:
        assert f"`{name}" in agent, name
    for name in router_names:
        assert f"`{name}" in router, name
    assert "| `lmcache_p2p_invalidated_chunks_total` | counter | `reason` |" in agent  # a part's, not AgentMetrics'


def test_field_docs_come_from_the_comments_at_the_field() -> None:
    source = '''
class C:
    """Not a field's."""

    # about a, line one
    # and line two
    a: int = 1  # and its trailing note
    b: int = 2  # noqa: E501

    # a comment a blank line above c belongs to nothing

    c: str = dataclasses.field(
        default_factory=str)  # on c's last line
    def f(self) -> None:
        # not a field
        pass
'''
    assert docsgen.field_docs(source) == {"C": {"a": "about a, line one and line two and its trailing note", "b": "",
                                                "c": "on c's last line"}}


def test_markdown_of_a_docstring() -> None:
    doc = '''First line with ``code`` and :class:`~lmcache_p2p.errors.ConfigError`.

    An example::

        key: value
        other: 1

    After the block.'''
    assert docsgen.markdown(doc) == ("First line with `code` and `ConfigError`.\n\nAn example:\n\n```text\n"
                                     "key: value\nother: 1\n```\n\nAfter the block.\n")
