"""The reference pages under ``docs/reference/``, written from the code so that they cannot drift from it:

- ``configuration.md``: every field of the config dataclasses (``config.py``) by section, with its type,
  default, environment variable and doc (the class docstring, the comments at the field, the checks
  ``__post_init__`` makes of it);
- ``cli.md``: every ``lmcache-p2p`` command's argparse help, in the groups ``lmcache-p2p --help`` shows;
- ``metrics.md``: every metric an agent (a :class:`~lmcache_p2p.agent.CacheAgent` built, never started)
  and the router register: the names as exposed, type, labels and help;
- ``request-params.md``: every name a request may send in ``kv_transfer_params``
  (``request_params.PARAMS``).

Regenerate them with::

    .venv/bin/python -m lmcache_p2p.docsgen docs/reference

``tests/test_docs_reference.py`` fails when the committed pages differ from what this writes.
:func:`parse_error` parses a command line with the parser the command itself builds, without running the
command (``tests/test_docs_commands.py`` holds every command the docs show to it).

Why one file of this size: one generator per reference page (the CLI, the configuration, the metrics, the request
parameters) over the Markdown helpers at its top, so that every generated page is written one way.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import cli, config
from .errors import ConfigError

REGENERATE = ".venv/bin/python -m lmcache_p2p.docsgen docs/reference"
HELP_COLUMNS = 100  # argparse wraps help to the terminal's width: fixed here, so the page is the same anywhere


def _header(title: str, source: str) -> str:
    return (f"# {title}\n\n> Generated from {source} by `{REGENERATE}`. Do not edit this page: change the code "
            "and regenerate (`tests/test_docs_reference.py` fails while it is stale).\n")


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def _inline(text: str) -> str:
    """reST inline markup (``code``, :func:`~a.b`) as Markdown."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return text.replace("``", "`")


def markdown(doc: str) -> str:
    """A docstring as Markdown: inline markup converted, ``::`` literal blocks fenced."""
    lines, out, i = inspect.cleandoc(doc).splitlines(), [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if not line.rstrip().endswith("::"):
            out.append(_inline(line))
            continue
        out.append(_inline(line.rstrip()[:-1]))
        block = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            block.append(lines[i])
            i += 1
        out += ["", "```text", *textwrap.dedent("\n".join(block)).strip("\n").splitlines(), "```", ""]
    return "\n".join(out).strip() + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# -- configuration ------------------------------------------------------------------------------------

def _comments(source: str) -> dict[int, tuple[bool, str]]:
    """line -> (the comment is the whole line, its text) for every comment but lint pragmas."""
    lines = source.splitlines()
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not text.startswith(("noqa", "type:")):
                out[tok.start[0]] = (lines[tok.start[0] - 1].lstrip().startswith("#"), text)
    return out


def field_docs(source: str) -> dict[str, dict[str, str]]:
    """class -> field -> its doc: the comment lines right above the field (no blank line between) and the
    comments on its own lines, for every annotated field of every top-level class of ``source``."""
    comments = _comments(source)
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in comments and comments[line][0]:
                above.insert(0, comments[line][1])
                line -= 1
            lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            trailing = [comments[n][1] for n in lines if n in comments and not comments[n][0]]
            docs[node.name][stmt.target.id] = " ".join(above + trailing)
    return docs


def _factories(node: ast.ClassDef) -> dict[str, str]:
    """field -> the source of its ``default_factory`` lambda's body."""
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(stmt.value, ast.Call):
            for kw in stmt.value.keywords:
                if kw.arg == "default_factory":
                    body = kw.value.body if isinstance(kw.value, ast.Lambda) else kw.value
                    out[stmt.target.id] = ast.unparse(body)
    return out


def _text(expr: ast.expr, env: dict[str, Any], strict: bool) -> str | None:
    """A string constant or f-string of config.py as text; a part that names more than module constants
    and the enclosing loops' variables is shown as "…" (None when ``strict``)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if not isinstance(expr, ast.JoinedStr):
        return None
    parts = []
    for value in expr.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
            continue
        assert isinstance(value, ast.FormattedValue)
        names = {n.id for n in ast.walk(value.value) if isinstance(n, ast.Name)}
        scope = {**vars(builtins), **vars(config), **env}
        if not names <= scope.keys():
            if strict:
                return None
            parts.append("…")  # the value refused, or another field's
            continue
        got = eval(compile(ast.Expression(value.value), config.__file__, "eval"), scope)  # config.py's own code
        text = repr(got) if value.conversion == ord("r") else str(got)
        parts.append("…" if " at 0x" in text else text)  # an object's address would differ each run
    return "".join(parts)


def _checks(node: ast.ClassDef) -> dict[str, list[str]]:
    """dotted field -> the messages ``__post_init__``'s ``_check(ok, field, message)`` calls give."""
    out: dict[str, list[str]] = {}

    def visit(stmts: list[ast.stmt], env: dict[str, Any]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name):
                try:
                    bindings = [{**env, stmt.target.id: v} for v in ast.literal_eval(stmt.iter)]
                except (ValueError, TypeError):
                    bindings = [env]  # over a field's value: the loop variable stays unknown
                for bound in bindings:
                    visit(stmt.body, bound)
                continue
            for call in ast.walk(stmt):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_check"
                        and len(call.args) == 3):
                    field, message = _text(call.args[1], env, True), _text(call.args[2], env, False)
                    if field is not None and message is not None and message not in out.get(field, []):
                        out.setdefault(field, []).append(message)

    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__post_init__":
            visit(stmt.body, {})
    return out


def _is_size(hint: Any, dotted: str) -> bool:
    """Whether the field takes sizes with units ("1Ki"), as the loader coerces it."""
    try:
        return bool(config._coerce("1Ki", hint, dotted) == 1024)
    except ConfigError:
        return False


def _type(hint: Any, dotted: str = "") -> str:
    if dotted and _is_size(hint, dotted):
        return "size"
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " \\| ".join("null" if a is type(None) else _type(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {_type(typing.get_args(hint)[0])}"
    return str(getattr(hint, "__name__", hint))


def _default(value: Any, size: bool) -> str:
    if size and isinstance(value, int) and value:
        for unit, power in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
            if value % (1 << power) == 0:
                return f"`{value >> power}{unit}`"
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _env(dotted: str) -> str:
    name = config.ENV_PREFIX + dotted.replace(".", "_").upper()
    return f"`{name}`" if config._from_env({name: "x"}) == config._nest(dotted, "x") else ""


def _section(prefix: str, cls: type, node: ast.ClassDef, docs: dict[str, str]) -> str:
    title = f"`{prefix}` (`{cls.__name__}`)" if prefix else f"Top level (`{cls.__name__}`)"
    out = [f"## {title}\n"]
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not the dataclass-made signature
        out.append(markdown(cls.__doc__))
    factories, checks = _factories(node), _checks(node)
    hints = typing.get_type_hints(cls)
    out += ["| Field | Type | Default | Environment | Description |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # a section of its own
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        size = _is_size(hints[f.name], dotted)
        if f.name in factories:
            default = f"computed: `{factories[f.name]}`"
        else:
            default = _default(f.default, size)
        env = _env(dotted) if config._known_dotted(dotted) else "not a setting"
        doc = _inline(docs.get(f.name, ""))
        if dotted in checks:
            doc += ("" if not doc or doc.endswith((".", ")")) else ".") + f" *Checked:* {'; '.join(checks[dotted])}"
        out.append(f"| `{dotted}` | {_type(hints[f.name], dotted)} | {default} | {env} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def configuration_page() -> str:
    source = inspect.getsource(config)
    tree, docs = ast.parse(source), field_docs(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    hints = typing.get_type_hints(config.AgentConfig)
    sections: list[tuple[str, type]] = [("", config.AgentConfig)]
    sections += [(f.name, hints[f.name]) for f in dataclasses.fields(config.AgentConfig)
                 if dataclasses.is_dataclass(hints[f.name])]
    parts = [_header("Configuration reference", "`lmcache_p2p/config.py`"), markdown(config.__doc__ or "")]
    parts.append("A *size* takes bytes or a number with a unit: " + _inline(config.parse_size.__doc__ or "")
                 .split("\n\n", 1)[-1].replace("\n    ", " ").strip() + "\n")
    parts += [_section(prefix, cls, classes[cls.__name__], docs[cls.__name__]) for prefix, cls in sections]
    return "\n".join(parts)


# -- the command line ---------------------------------------------------------------------------------

class _Reached(BaseException):  # not caught by a main's `except Exception`
    def __init__(self, parser: argparse.ArgumentParser, args: list[str]) -> None:
        super().__init__(parser.prog)
        self.parser, self.argv = parser, args


class _Refused(BaseException):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def _patched(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    real = getattr(argparse.ArgumentParser, name)
    setattr(argparse.ArgumentParser, name, replacement)
    try:
        yield
    finally:
        setattr(argparse.ArgumentParser, name, real)


def command_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, list[str]] | None:
    """The parser ``lmcache-p2p ARGV`` parses its arguments with and the arguments it hands it, without
    running the command: its main stops where it would parse. None when the top level answers by itself
    (``--version``, ``help``); :class:`ValueError` for a command that does not exist."""

    def reached(self: argparse.ArgumentParser, args: Sequence[str] | None = None, namespace: object = None) -> None:
        raise _Reached(self, list(sys.argv[1:] if args is None else args))

    out = io.StringIO()
    with _patched("parse_args", reached), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = cli.main(list(argv))
        except _Reached as stop:
            return stop.parser, stop.argv
    if status != 0:
        raise ValueError(f"no such command: lmcache-p2p {' '.join(argv)} (`lmcache-p2p --help` lists them)")
    return None


def parse_error(argv: Sequence[str]) -> str | None:
    """Why ``lmcache-p2p ARGV`` would be refused by its parser, or None when it parses (nothing runs)."""
    try:
        found = command_parser(argv)
    except ValueError as exc:
        return str(exc)
    if found is None:
        return None
    parser, args = found

    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise _Refused(2, f"{self.prog}: error: {message}")

    def leave(self: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> None:
        raise _Refused(status, message or f"{self.prog}: exit {status}")

    out = io.StringIO()
    with _patched("error", error), _patched("exit", leave), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        try:
            parser.parse_args(args)
        except _Refused as exc:
            return None if exc.status == 0 else str(exc)
    return None


@contextlib.contextmanager
def _columns(n: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n + 2)  # argparse: the terminal's width less 2
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _grouped() -> list[tuple[str, list[tuple[str, ...]]]]:
    """The commands in the groups of ``lmcache-p2p --help`` (a command in no group is under "run")."""
    grouped = {word for _, words in cli.GROUPS for word in words}
    return [(group, [c for c in cli.COMMANDS if c[0] in words or (group == "run" and c[0] not in grouped)])
            for group, words in cli.GROUPS]


def _help(words: tuple[str, ...], parser: argparse.ArgumentParser, level: int) -> list[str]:
    summary = cli.COMMANDS.get(words, ("", ""))[1]
    out = [f"{'#' * level} `lmcache-p2p {' '.join(words)}`", ""]
    out += [summary, ""] if summary else []
    out += ["```text", parser.format_help().rstrip("\n"), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _help((*words, name), sub, level + 1)
    return out


def cli_page() -> str:
    with _columns(HELP_COLUMNS):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["--help"])
        parts = [_header("CLI reference", "the parsers of `lmcache_p2p/cli/` and `lmcache_p2p/bench/`"),
                 "`lmcache-p2p --help`:", "", "```text", out.getvalue().rstrip("\n"), "```", ""]
        for group, commands in _grouped():
            parts += [f"## {group}", ""]
            for words in commands:
                found = command_parser(words)
                assert found is not None, words
                parts += _help(words, found[0], 3)
    return "\n".join(parts)


# -- metrics ------------------------------------------------------------------------------------------

_EXPOSED = {"counter": ("_total",), "info": ("_info",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def _metric_rows(registry: Any, labels: dict[str, tuple[str, ...]]) -> list[str]:
    """One table row per metric family the registry collects, by exposed name."""
    for collector, names in registry._collector_to_names.items():  # prometheus_client's own bookkeeping
        declared = getattr(collector, "_labelnames", None)
        if declared is not None:
            labels.update({name: tuple(declared) for name in names})
    rows = {}
    for family in registry.collect():
        exposed = ", ".join(f"`{family.name}{s}`" for s in _EXPOSED.get(family.type, ("",)))
        names = labels.get(family.name)
        if names is None:  # a custom collector: the labels its samples carry
            names = tuple(sorted({k for s in family.samples for k in s.labels if k not in ("le", "quantile")}))
        cells = (exposed, family.type, ", ".join(f"`{n}`" for n in names), _cell(family.documentation))
        rows[family.name] = "| " + " | ".join(cells) + " |"
    return [rows[name] for name in sorted(rows)]


def _agent_rows() -> list[str]:
    from .agent import CacheAgent
    from .keys import Fingerprint

    base = config.AgentConfig(node_id="docs")
    chunk_bytes = base.layout.chunk_bytes(base.chunk_size)
    agent_config = dataclasses.replace(base, tiers=config.TierConfig(cpu_capacity=chunk_bytes))  # one slot
    agent = CacheAgent(agent_config, Fingerprint.of(base.layout), chunk_bytes)
    try:
        return _metric_rows(agent.metrics.registry, dict(agent.metrics.live_counters()))
    finally:
        agent.stop(flush_to_disk=False)


def metrics_page() -> str:
    from .router.metrics import Metrics

    head = ["| Name (as exposed) | Type | Labels | Help |", "|---|---|---|---|"]
    return "\n".join([
        _header("Metrics reference", "the registries of `AgentMetrics` (with the agent's parts) and the router"),
        "Counters and histograms also expose a `_created` series (prometheus_client's default).", "",
        "## Agent", "", "On `metrics_host`:`metrics_port` at `/metrics` (off unless `metrics_port` is set).", "",
        *head, *_agent_rows(), "",
        "## Router", "", "On the router's `--host`:`--port` at `/metrics`.", "",
        *head, *_metric_rows(Metrics().registry, {}), ""])


def request_params_page() -> str:
    from . import request_params

    doc = (request_params.__doc__ or "").split("\n\n")
    rows = [f"| `{p.name}` | {_cell(p.takes)} | {_cell(p.does)} | {_cell(p.bound)} | {_cell(p.beyond)} |"
            for p in request_params.PARAMS]
    return "\n".join([
        _header("Request parameters (`kv_transfer_params`)", "`lmcache_p2p/request_params.py` (`PARAMS`)"),
        markdown("\n\n".join(doc[1:3])),
        "A client sends them in the body of an OpenAI-compatible request to vLLM, e.g. "
        '`{"prompt": ..., "kv_transfer_params": {"lmcache_p2p_canary": true}}`; the router passes them on.', "",
        "| Name | Takes | Does | Bound | Beyond it |", "|---|---|---|---|---|", *rows, ""])


PAGES: dict[str, Callable[[], str]] = {"configuration.md": configuration_page, "cli.md": cli_page,
                                       "metrics.md": metrics_page, "request-params.md": request_params_page}


def generate(out_dir: Path) -> list[Path]:
    """Write every page into ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, page in PAGES.items():
        path = out_dir / name
        path.write_text(page())
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_p2p.docsgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the pages go (docs/reference)")
    args = parser.parse_args(argv)
    for path in generate(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
