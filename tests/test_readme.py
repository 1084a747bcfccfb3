"""The README stays true: its Quick start is what CI runs, and it documents every option."""

from __future__ import annotations

import re

from sbp_spark.spark.options import OPTIONS
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def _quick_start_blocks() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_quick_start_has_setup_then_tests():
    setup, tests = _quick_start_blocks()[:2]
    assert 'pip install -e ".[test]"' in setup and "sbp demo" in setup
    assert "python -m pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    tests_block = _quick_start_blocks()[1]
    command = [line for line in tests_block.splitlines() if "pytest" in line][0].strip()
    assert command in ci
    assert 'pip install -q -e ".[test]" --config-settings editable_mode=compat' in ci


def test_every_option_is_in_the_readme_table():
    missing = [o.name for o in OPTIONS if f"| `{o.name}` | {o.default} |" not in README]
    assert not missing, f"README option table lacks: {missing}"


# -- the options table, row by row -------------------------------------------------------------


def _readme_option_rows() -> list[str]:
    section = README.split("### Options", 1)[1].split("\n### ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def test_the_readme_option_table_is_the_connectors_own():
    """Every row (name, default, where it applies, meaning) is what the connector declares, in
    its order, and the table names no option the connector would refuse."""
    from sbp_spark.spark.options import OPTIONS

    declared = [f"| `{o.name}` | {o.default} | {o.where} | {o.meaning} |" for o in OPTIONS]
    assert _readme_option_rows() == declared


def test_every_shown_default_is_the_default_used():
    """A default shown as a value (`64m`, `15m`, `true`) is what the option parses to when it is
    not given; one shown in words is a parenthesised note or names where it comes from."""
    from sbp_spark.spark.options import OPTIONS, OptionError

    for spec in OPTIONS:
        try:
            parsed = spec.check(spec.name, spec.default)
        except OptionError:
            assert spec.value is None, spec
            continue
        assert parsed == spec.value, (spec.name, spec.default, spec.value)


# -- the `sbp` commands and flags the README shows ---------------------------------------------


def _sbp_command_lines(text: str) -> list[list[str]]:
    """Every `sbp ...` command of the text: the lines of its bash blocks (continuations joined,
    comments and shell syntax dropped) and its inline code spans (`sbp tail ID [-f]`)."""
    import shlex

    lines: list[list[str]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|", line):
                words = shlex.split(part.split(" #", 1)[0].replace("&", " "), posix=True)
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # SBP_PD=... sbp ...
                if words[:1] == ["sbp"]:
                    lines.append(words[1:])
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`(sbp [^`]+)`", prose.replace("\n", " ")):
        lines.append(span.replace("\\|", "|").split()[1:])
    return lines


def _subcommand(parser, words: list[str]):
    """The parser of the (sub)command ``words`` start with, and the words after it; each of
    alternatives written `list|describe` must be a command."""
    import argparse

    while words:
        commands = next((a.choices for a in parser._actions
                         if isinstance(a, argparse._SubParsersAction)), None)
        names = [w.split()[0] for w in words[0].split("|")]
        if not commands or names[0] not in commands:
            break
        assert all(name in commands for name in names), f"no such command: {words[0]}"
        parser, words = commands[names[0]], words[1:]
    return parser, words


def _bench_help() -> str:
    import contextlib
    import io

    from sbp_spark.bench.harness import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_args(["--help"])
    return out.getvalue()


def test_every_sbp_command_and_flag_in_the_docs_exists():
    from sbp_spark.cli import build_parser

    root = build_parser()
    docs = [README, *((REPO / "docs" / name).read_text() for name in ("reliability.md",))]
    checked = 0
    for text in docs:
        for words in _sbp_command_lines(text):
            # `sbp --pd H:P streams list`: the PD may come before the command.
            if words[:1] == ["--pd"]:
                words = words[2:]
            parser, rest = _subcommand(root, words)
            assert parser is not root, f"no such command: sbp {' '.join(words)}"
            flags = {s for a in parser._actions for s in a.option_strings}
            if parser.prog == "sbp bench":  # its harness parses its arguments
                flags = set(re.findall(r"--[a-z][\w-]*", _bench_help()))
            for word in rest:
                for flag in re.findall(r"(?:^|[\[|])(--?[a-z][\w-]*)", word):
                    assert flag in flags, f"sbp {' '.join(words)}: {parser.prog} has no {flag}"
            checked += 1
    assert checked > 20


# -- files the docs point at -------------------------------------------------------------------


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_link_and_path_in_the_docs_exists():
    """Relative links, backticked repository paths (`sbp_spark/server/read_cap.py`, or a module
    named within its package, `read_cap.py`), and named tests (`file.py::test_name`)."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    folders = {"/".join(f.split("/")[:i]) + "/"
               for f in tracked for i in range(1, f.count("/") + 1)}
    known = set(tracked) | folders
    missing = []
    for md in DOCS:
        text = md.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if path and not target.startswith(("http://", "https://")) \
                    and not (md.parent / path).exists():
                missing.append(f"{md.name}: link {target}")
        for path in re.findall(r"`([\w./-]+(?:\.py|\.md|\.fbs|\.yml|\.toml|/))(?:::\w+)?`", text):
            if not any(k == path or k.endswith("/" + path) for k in known):
                missing.append(f"{md.name}: {path}")
        for path, name in re.findall(r"`((?:tests|integration)/[\w/]+\.py)::(\w+)", text):
            source = REPO / path
            if not source.exists() or f"def {name}(" not in source.read_text():
                missing.append(f"{md.name}: {path}::{name}")
        for name in re.findall(r"`(test_\w+)`", text):  # a test named without its file
            if not any(f"def {name}(" in (REPO / f).read_text() for f in tracked
                       if f.endswith(".py") and f.startswith(("tests/", "integration/"))):
                missing.append(f"{md.name}: {name}")
    assert not missing, missing


# -- the Python snippets -----------------------------------------------------------------------


def test_the_readme_python_snippets_define_every_name_they_use():
    """Read in order, as one session would run them, the README's Python blocks use no name
    they have not imported or assigned (a reader pasting them gets no NameError)."""
    import ast
    import builtins

    defined = set(dir(builtins))
    undefined = []
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):  # a parameter, inside its function
                defined.add(node.arg)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                defined.add(node.name)
        loads = sorted((n.lineno, n.id) for n in ast.walk(tree)
                       if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
        undefined += [f"{name} (in {block.splitlines()[0]!r})" for _, name in loads
                      if name not in defined]
    assert not undefined, undefined


def test_the_python_client_section_runs_as_written(tmp_path):
    """The blocks of "Python client", in order, against a cluster of their own: they hold
    their own checks (appends, reads, the tail, the errors); the stream ends as they left it."""
    from sbp_spark.protocol.records import batch_body
    from sbp_spark.server.cluster import EmbeddedCluster

    section = README.split("\n## Python client\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 4
    with EmbeddedCluster(tmp_path, range_servers=3) as cluster:
        namespace: dict = {}
        for block in blocks:
            code = block.replace("127.0.0.1:2378", cluster.pd_address)
            exec(compile(code, "README.md", "exec"), namespace)
        client, log = namespace["client"], namespace["log"]
        bodies = [bytes(batch_body(b.data)) for b in client.read(log)]
        # first, second, third, the Arrow batch of three records, news, important
        assert bodies[:3] == [b"first", b"second", b"third"]
        assert bodies[4:] == [b"news", b"important"]
        assert [s.stream_id for s in client.list_streams()] == [log]
