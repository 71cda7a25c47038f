"""Every ``lmcache-p2p`` command in a shell code block of README.md and docs/ parses with the command's own
argparse parser (``docsgen.parse_error``: the parser its main builds, nothing run), and every relative
link in them points at a file that exists.

A command is a shell line (continuations joined, ``$ `` prompts, comments, redirections and the env-var
assignments, ``sudo``/``env`` in front dropped) whose command word is ``lmcache-p2p`` (any path to it) or
``python -m lmcache_p2p``, also after ``--`` (``kubectl exec ... -- lmcache-p2p ...``). Placeholders
(``<file>``) and shell expansions (``$VAR``, ``${VAR}``, ``$(...)``) stand for a value: argparse may refuse
that value's type or choice, nothing else.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_p2p.docsgen import parse_error

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh", "shell-session"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
VALUE = "1"  # what a placeholder or a shell expansion stands for when parsed
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\s]*(?: [^<>\s]+)*>|\$\([^()]*\)|\$\{[^}]*\}|\$[A-Za-z_]\w*")
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "|&", ";;", "{", "}", "!"}
WRAPPERS = {"sudo", "env", "exec", "nohup", "time", "command", "then", "do", "else"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Command:
    path: Path
    line: int
    text: str
    argv: tuple[str, ...]
    placeholders: bool
    shell_error: str | None = None

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def code_blocks(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, line)]) of each fenced code block."""
    fence, language = "", ""
    lines: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not fence:
            if m:
                fence, language, lines = m.group(1), m.group(2).lower(), []
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
            yield language, lines
            fence = ""
        else:
            lines.append((number, line))


def shell_lines(language: str, lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Logical shell lines: continuations and (in a block marked as shell) quotes open across lines joined,
    prompts dropped (console: output lines too), heredocs skipped."""
    pending: tuple[int, str] | None = None
    heredoc = ""
    for number, raw in lines:
        line = raw.strip()
        if heredoc:
            heredoc = "" if line == heredoc else heredoc
            continue
        if pending is None:
            if line.startswith("$ "):
                line = line[2:]
            elif language == "console":
                continue
            pending = (number, "")
        start, text = pending
        text += line
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        if language and open_quote(text):
            pending = (start, text + "\n")
            continue
        pending = None
        m = re.search(r"<<-?\s*['\"]?(\w+)", text)
        heredoc = m.group(1) if m else ""
        yield start, text
    if pending is not None:
        yield pending


def _scan(line: str) -> tuple[int, str]:
    """Where a shell comment starts in the line (its length if none), and the quote still open there."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i, ""
    return len(line), quote


def open_quote(line: str) -> str:
    return _scan(line)[1]


def strip_comment(line: str) -> str:
    """The line without a shell comment (``#`` starting a word outside quotes)."""
    return line[:_scan(line)[0]]


def words(line: str) -> list[str]:
    line = re.sub(r"(?<![\w=])\d+(?=[<>])", "", strip_comment(line))  # 2>&1: the fd goes with the redirection
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def segments(tokens: list[str]) -> Iterator[list[str]]:
    """Simple commands: split at pipes and lists, redirections and their targets left out."""
    current: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in SEPARATORS:
            yield current
            current = []
        elif set(tok) <= set("<>&|") and ("<" in tok or ">" in tok):
            skip = True  # the redirection's target
        else:
            current.append(tok)
    yield current


def lmcache_argv(segment: list[str]) -> list[str] | None:
    """The arguments after ``lmcache-p2p`` when it is this simple command's command word."""
    i = 0
    while i < len(segment) and (ASSIGNMENT.match(segment[i]) or segment[i] in WRAPPERS
                                or (i and segment[i - 1] in WRAPPERS and segment[i].startswith("-"))):
        i += 1
    if i == len(segment):
        return None
    if segment[i].rsplit("/", 1)[-1] == "lmcache-p2p":
        return segment[i + 1:]
    if re.fullmatch(r"(.*/)?python3?(\.\d+)?", segment[i]) and segment[i + 1:i + 3] == ["-m", "lmcache_p2p"]:
        return segment[i + 3:]
    if "--" in segment[i + 1:]:  # kubectl exec POD -- lmcache-p2p ...
        return lmcache_argv(segment[segment.index("--", i + 1) + 1:])
    return None


def commands_in(path: Path, text: str) -> list[Command]:
    out = []
    for language, lines in code_blocks(text):
        if language not in SHELL_LANGUAGES:
            continue
        for number, line in shell_lines(language, lines):
            if "lmcache-p2p" not in line and "lmcache_p2p" not in line:
                continue
            marked, n = PLACEHOLDER.subn(VALUE, line)
            try:
                tokens = words(marked)
            except ValueError as exc:  # unbalanced quotes: output or a diagram in a block of no language
                if language:
                    out.append(Command(path, number, line.strip(), (), False, f"not a shell line: {exc}"))
                continue
            for segment in segments(tokens):
                argv = lmcache_argv(segment)
                if argv is not None:
                    out.append(Command(path, number, line.strip(), tuple(argv), n > 0))
    return out


def refusal(command: Command) -> str | None:
    """Why the command's parser refuses it (None: it parses)."""
    if command.shell_error is not None:
        return command.shell_error
    error = parse_error(command.argv)
    value_refused = re.search(rf"invalid (?:\w+ value|choice): '{VALUE}'", error or "")
    return None if error is None or (command.placeholders and value_refused) else error


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_LINK = re.compile(r"(?:href|src)=\"([^\"]+)\"")


def prose(text: str) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code, inline code spans blanked."""
    fenced = {number for _, lines in code_blocks(text) for number, _ in lines}
    for number, line in enumerate(text.splitlines(), 1):
        if number not in fenced and not FENCE.match(line):
            yield number, re.sub(r"(`+).+?\1", "", line)


def broken_links(path: Path, text: str, root: Path = ROOT) -> list[str]:
    out = []
    for number, line in prose(text):
        for pattern in (LINK, REFERENCE_LINK, HTML_LINK):
            for target in pattern.findall(line):
                if re.match(r"^[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, mailto:, an anchor on this page
                file = urllib.parse.unquote(re.split(r"[#?]", target, maxsplit=1)[0])
                resolved = root / file.lstrip("/") if file.startswith("/") else path.parent / file
                if not resolved.exists():
                    out.append(f"{path.relative_to(root)}:{number}: link to {target} (no {resolved})")
    return out


def _files() -> list[Path]:
    return [p for p in doc_files() if p.exists()]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_parse(path: Path) -> None:
    failures = [f"{c.where()}: {c.text}\n    {err}" for c in commands_in(path, path.read_text())
                if (err := refusal(c)) is not None]
    assert not failures, "commands the CLI refuses:\n" + "\n".join(failures)


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    failures = broken_links(path, path.read_text())
    assert not failures, "links to nothing:\n" + "\n".join(failures)


def test_the_docs_show_commands() -> None:
    """The extractor finds the docs' commands (a test that found none would hold nothing)."""
    found = [c for p in _files() for c in commands_in(p, p.read_text())]
    assert len(found) >= 5, found


# -- the extractor itself, on text made to provoke each rule ------------------------------------------

SAMPLE = """\
Prose mentioning lmcache-p2p nowhere runnable: `lmcache-p2p nope`.

```bash
# a comment line; lmcache-p2p in it is not a command
LMCACHE_P2P_CONFIG=agent.yaml lmcache-p2p status --json   # trailing comment
lmcache-p2p router --etcd http://etcd:2379 \\
    --host 0.0.0.0 --port 8080 2>&1 | tee router.log
sudo -E .venv/bin/lmcache-p2p doctor --config <agent.yaml> && echo ok
lmcache-p2p router --port $PORT
lmcache-p2p router --policy <policy>
kubectl -n lmcache-p2p exec pod/a -- lmcache-p2p bench kernels --json
python -m lmcache_p2p status --bogus
cat <<EOF > x
lmcache-p2p not-a-command-in-a-heredoc
EOF
vllm serve m --kv-transfer-config '{"kv_connector": "X",
    "kv_role": "kv_both"}' > vllm.log 2>&1 & lmcache-p2p etcd --members 3
```

```console
$ lmcache-p2p --version
lmcache-p2p 0.1.0
```

```text
lmcache-p2p status [--etcd URLS]
```

```yaml
command: ["lmcache-p2p", "agent"]
```

```sh
lmcache-p2p status --etcd 'http://a:2379
```
"""


def test_extracts_commands_as_a_shell_would(tmp_path: Path) -> None:
    found = commands_in(tmp_path / "x.md", SAMPLE)
    assert [(c.line, c.argv) for c in found] == [
        (5, ("status", "--json")),
        (6, ("router", "--etcd", "http://etcd:2379", "--host", "0.0.0.0", "--port", "8080")),
        (8, ("doctor", "--config", VALUE)),
        (9, ("router", "--port", VALUE)),
        (10, ("router", "--policy", VALUE)),
        (11, ("bench", "kernels", "--json")),
        (12, ("status", "--bogus")),
        (16, ("etcd", "--members", "3")),  # after a quote open across lines
        (21, ("--version",)),
        (34, ()),  # its quote never closes
    ]
    errors = {c.line: refusal(c) for c in found}
    assert all(errors[line] is None for line in (5, 6, 8, 16, 21))
    assert errors[9] is None and errors[10] is None  # a placeholder's value is not held against the line
    assert errors[11] == "lmcache-p2p bench kernels: error: unrecognized arguments: --json"
    assert "unrecognized arguments: --bogus" in (errors[12] or "")
    assert errors[34] == "not a shell line: No closing quotation"


def test_a_refused_command_is_named_with_its_place(tmp_path: Path) -> None:
    doc = tmp_path / "guide.md"
    doc.write_text("Intro.\n\n```sh\nlmcache-p2p statu --json\n```\n")
    (command,) = commands_in(doc, doc.read_text())
    assert command.where().endswith("guide.md:4")
    assert "no such command: lmcache-p2p statu --json" in (refusal(command) or "")


def test_broken_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    text = ("[ok](there.md#part) [web](https://example.com) [anchor](#top) ![img](/docs/there.md)\n"
            "[gone](missing.md) `[code](nothing.md)`\n[ref]: ../nowhere.md\n"
            "```\n[in code](absent.md)\n```\n")
    assert broken_links(page, text, tmp_path) == [
        f"docs/page.md:2: link to missing.md (no {tmp_path}/docs/missing.md)",
        f"docs/page.md:3: link to ../nowhere.md (no {tmp_path}/docs/../nowhere.md)",
    ]
