"""Every ``python -m jaxray...`` command the READMEs and docs/ show exists and parses.

The commands come from README.md, serve/README.md and every docs/*.md: fenced code blocks (``\\``
continuations joined, ``# comments`` dropped, a leading ``.venv/bin/python`` or ``ENV=... ``
allowed) and inline code spans (also across a line break), with their shorthand (``bench compile``,
``jaxray.doctor --json``). Each is parsed by the module's own argparse parser, with its values,
without running anything: one subprocess imports every module, takes the parser the module's
``main`` builds (``ArgumentParser.parse_args`` is intercepted at its first call, before anything
runs) and parses each command with it, abbreviations of options disallowed. So a flag the parser
does not have, a sub-command it does not know (``bench comapre``), a value outside its ``choices``
or of the wrong type (``--batch x``) fails the test with argparse's own message. And
cluster/local-up.sh prints the README's ``ray job submit`` command.

What the docs write as notation, not as a command line, is read as such: ``[--opt V]`` is the
option, ``[...]`` and ``[any option below]`` are dropped, ``a|b`` (``a\\|b`` in a table) checks each
alternative, and a value that is a placeholder (``DIR``, ``N``, ``runs/<experiment>``, ``$PWD/...``)
or a folder that need not exist here is not type-checked. Required options are not required: a
command mentioned by name (``python -m jaxray.export``) only has to exist. Checks a module does after
parsing (``--resume`` with ``--out``, say) are not made.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "serve/README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
)
# Every module a user runs; the docs must show each at least once (else the extractor went blind).
MODULES = (
    "jaxray.tune",
    "jaxray.generate",
    "jaxray.evaluate",
    "jaxray.export",
    "jaxray.doctor",
    "jaxray.data",
    "jaxray.bench",
    "jaxray.serve",
)
COMMAND = re.compile(r"(?:(?<=\s)|^)(?:[\w./-]*/)?python3? -m (jaxray[\w.]*)")
# The docs' shorthand for a command: `bench compile`, `jaxray.doctor --json`.
SHORTHAND = re.compile(r"^(?:jaxray\.(?=[a-z]+ -)|(?=bench [a-z]))")
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}  # a block of another language, or none, is no command
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>", "<", "2>&1", "&"}
PLACEHOLDER = r"^[A-Z][A-Z_]*$|[<$]|\.\.\."


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as the doc writes it, on one line
    module: str
    argvs: tuple[tuple[str, ...], ...]  # one per alternative of an ``a|b`` value
    problem: str = ""  # the text could not be read as a command line (unbalanced quotes)


def snippets(text: str) -> list[tuple[int, str]]:
    """(line number, shell text) of each line of a shell code block and each inline code span."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    fenced, shell, pending, start, prose = False, False, "", 0, []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced, shell = not fenced, line.strip()[3:] in SHELL_BLOCKS
            continue
        if not (fenced and shell):
            if not fenced:
                prose.append((number, line))
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    for number, paragraph in _paragraphs(prose):
        for span in re.finditer(r"`([^`]+)`", paragraph):
            out.append((number + paragraph.count("\n", 0, span.start()), span[1].replace("\n", " ")))
    return sorted(out, key=lambda item: item[0])


def _paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Prose lines joined into paragraphs (a code span never crosses a blank line)."""
    out, current, first = [], [], 0
    for number, line in [*prose, (0, "")]:
        if line.strip() and (not current or number == first + len(current)):
            first = first if current else number
            current.append(line)
            continue
        if current:
            out.append((first, "\n".join(current)))
        current, first = ([line], number) if line.strip() else ([], 0)
    return out


def commands(text: str, doc: str) -> list[Command]:
    """Every ``python -m jaxray...`` command in ``text`` (a Markdown document named ``doc``)."""
    found = []
    for line, snippet in snippets(text):
        snippet = SHORTHAND.sub("python -m jaxray.", snippet)
        starts = list(COMMAND.finditer(snippet))
        for i, match in enumerate(starts):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(snippet)
            found.append(_command(doc, line, match[1], snippet[match.start() : end].strip()))
    return found


def _command(doc: str, line: int, module: str, text: str) -> Command:
    tail = text.split(module, 1)[1].replace("\\|", "|")
    # [--opt V] is the option; [...] and [any option below] are notation, dropped.
    tail = re.sub(r"\[([^\[\]]*)\]", lambda m: m[1] if m[1].lstrip().startswith("-") else " ", tail)
    try:
        tokens = shlex.split(tail, comments=True)
    except ValueError as err:
        return Command(doc, line, text, module, (), f"not a shell command line ({err})")
    cut = next((i for i, t in enumerate(tokens) if t in SHELL_OPERATORS), len(tokens))
    tokens = tokens[:cut]
    options = [t.split("|") if "|" in t and not t.startswith("-") else [t] for t in tokens]
    variants = max((len(o) for o in options), default=1)
    argvs = tuple(tuple(o[min(v, len(o) - 1)] for o in options) for v in range(variants))
    return Command(doc, line, text, module, argvs)


# Runs in a subprocess: imports each module, takes the parser its main builds and parses the
# commands with it. Reads {module: [argv, ...]} on stdin, prints RESULTS {module: ...}.
PARSE = r"""
import argparse, contextlib, io, json, re, runpy, sys

PLACEHOLDER = re.compile(sys.argv[1])
original = argparse.ArgumentParser.parse_args


class Captured(Exception):
    pass


def capture(self, *args, **kwargs):
    raise Captured(self)


def parsers(p):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def lenient(kind):
    def convert(text):
        if PLACEHOLDER.search(text) or getattr(kind, "__name__", "") == "folder":
            return text
        return kind(text)

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def relax(parser):
    for p in parsers(parser):
        p.allow_abbrev = False
        for group in p._mutually_exclusive_groups:
            group.required = False
        for action in p._actions:
            action.required = False
            if callable(action.type):
                action.type = lenient(action.type)


def parse(parser, argv):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if argv and subs and PLACEHOLDER.search(argv[0]):
        return None  # `python -m jaxray.bench NAME`: any sub-command
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            original(parser, list(argv))
    except SystemExit as exit:
        if exit.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


wanted = json.load(sys.stdin)
results = {}
argparse.ArgumentParser.parse_args = capture
for module, argvs in wanted.items():
    sys.argv = [module]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        results[module] = {"error": "its main never parsed a command line"}
    except Captured as captured:
        relax(captured.args[0])
        results[module] = {"results": [parse(captured.args[0], argv) for argv in argvs]}
    except BaseException as err:
        results[module] = {"error": f"{type(err).__name__}: {err}"}
print("RESULTS " + json.dumps(results))
"""


def parse_all(found: list[Command]) -> dict[tuple[str, tuple[str, ...]], str | None]:
    """{(module, argv): argparse's error or None} for every argv of ``found``; a module that does
    not exist, or whose main builds no parser, gives its error for each of its argvs."""
    wanted: dict[str, list[tuple[str, ...]]] = {}
    for command in found:
        for argv in command.argvs:
            if argv not in wanted.setdefault(command.module, []):
                wanted[command.module].append(argv)
    env = dict(os.environ)
    env.setdefault("JAXRAY_DATA_DIR", str(ROOT.parent / "shared" / "data"))  # as make test
    proc = subprocess.run(
        [sys.executable, "-c", PARSE, PLACEHOLDER],
        input=json.dumps(wanted),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"the parsing subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    results = json.loads(lines[-1][len("RESULTS ") :])
    out = {}
    for module, argvs in wanted.items():
        answer = results[module]
        for i, argv in enumerate(argvs):
            out[module, argv] = answer.get("error") or answer["results"][i]
    return out


def problems(found: list[Command], parsed) -> list[str]:
    """One line per command of ``found`` that does not parse, naming its doc and line."""
    out = []
    for c in found:
        errors = [c.problem] if c.problem else [e for a in c.argvs if (e := parsed[c.module, a])]
        out += [f"{c.doc}:{c.line}: `{c.text}`: {e}" for e in dict.fromkeys(errors)]
    return out


def doc_commands() -> list[Command]:
    return [c for doc in DOCS for c in commands((ROOT / doc).read_text(encoding="utf-8"), doc)]


# A copy of the README with one mistake of each kind a doc can make, appended at its end.
BROKEN = """
Bogus ones: `python -m jaxray.generate --checkpoint runs/demo --no-such-flag 3`,
`python -m jaxray.bench comapre --reference x.py`, and

```bash
python -m jaxray.data prepare --dataset tinyshakespeare\\
    --out data/parquet/x --seq-len lots   # a value of the wrong type
.venv/bin/python -m jaxray.nosuch --help
```

| `python -m jaxray.evaluate --checkpoint PATH [--workload mlp\\|cnn]` | a choice it lacks |
"""
BROKEN_ERRORS = (
    "unrecognized arguments: --no-such-flag 3",
    "invalid choice: 'comapre'",
    "argument --seq-len: expected a positive integer, got 'lots'",
    "No module named jaxray.nosuch",
    "argument --workload: invalid choice: 'cnn'",
)


@functools.cache
def parsed_docs():
    broken = commands((ROOT / "README.md").read_text(encoding="utf-8") + BROKEN, "broken")
    return broken, parse_all(doc_commands() + broken)


FOUND = {(c.module, c.argvs): c for c in doc_commands()}


@pytest.mark.parametrize("command", FOUND.values(), ids=[f"{c.doc}:{c.line}" for c in FOUND.values()])
def test_doc_command_parses(command: Command) -> None:
    """The command, as the doc writes it, parses with its module's own parser."""
    assert not problems([command], parsed_docs()[1])


def test_every_module_is_shown() -> None:
    """The docs show every command-line module, and the extractor finds them."""
    shown = {c.module for c in FOUND.values()}
    assert set(MODULES) <= shown, f"not found in {DOCS}: {sorted(set(MODULES) - shown)}"
    assert len(FOUND) >= 40


def test_a_broken_copy_fails() -> None:
    """Each mistake in a copy of the README (an unknown flag, sub-command, module or choice, a
    value of the wrong type) is reported with argparse's message; the real commands still pass."""
    broken, parsed = parsed_docs()
    reported = problems(broken, parsed)
    for error in BROKEN_ERRORS:
        assert [line for line in reported if error in line], f"not reported: {error}\n" + "\n".join(reported)
    assert len(reported) == len(BROKEN_ERRORS) + len(problems(doc_commands(), parsed)), reported


def test_docs_folder_is_read() -> None:
    """docs/*.md is part of what the commands are taken from, and each of its files shows one."""
    docs = [doc for doc in DOCS if doc.startswith("docs/")]
    assert docs, "no docs/*.md found"
    shown = {c.doc for c in doc_commands()}
    mention = [doc for doc in docs if "python -m jaxray" in (ROOT / doc).read_text(encoding="utf-8")]
    assert mention and set(mention) <= shown, f"no command found in {sorted(set(mention) - shown)}"


def test_local_up_prints_the_readme_submission() -> None:
    """cluster/local-up.sh's printed submit hint is the docs' one ``ray job submit`` command to the
    local head, and leaves ``--data-dir`` out when JAXRAY_DATA_DIR is exported (the job gets the
    head's environment)."""
    texts = [(ROOT / doc).read_text(encoding="utf-8") for doc in DOCS]
    readme = [s for text in texts for _, s in snippets(text) if "ray job submit --address" in s]
    assert len(readme) == 1, readme
    script = (ROOT / "cluster" / "local-up.sh").read_text(encoding="utf-8")
    hint = re.search(r"^data_dir=.*?^echo \"submit: .*?\"$", script, re.S | re.M)
    assert hint, "local-up.sh prints no 'submit:' line"
    printed = {}
    for data_dir in ("", "/data"):
        env = {"PATH": os.environ["PATH"], "port": "8265", "JAXRAY_DATA_DIR": data_dir}
        run = subprocess.run(["bash", "-c", hint[0]], env=env, capture_output=True, text=True, check=True)
        printed[data_dir] = shlex.split(run.stdout.removeprefix("submit: "))
    assert printed[""] == shlex.split(readme[0])
    data_flag = printed[""].index("--data-dir")
    assert printed["/data"] == printed[""][:data_flag] + printed[""][data_flag + 2 :]


def test_extractor_reads_the_notations() -> None:
    """Continuations, comments, brackets, alternatives, spans across lines, shell operators, and
    only shell code blocks."""
    text = (
        "See `python -m\njaxray.tune --config a.yaml [--out DIR] [...]`.\n\n"
        "```bash\n"
        "JAXRAY_DATA_DIR=d .venv/bin/python -m jaxray.bench ingest \\\n"
        "    --workload mlp|all   # [--parquet DIR]\n"
        "python -m jaxray.doctor --json && python -m jaxray.generate --checkpoint x | head\n"
        "python -m pytest tests -q\n"
        "```\n"
        "| `python -m jaxray.generate --sampler kv\\|full` | ... |\n"
        "Steps: `jaxray.doctor --json`; `bench compile --json`; `jaxray.serve.app:app_builder`.\n"
        "```\njaxray/bench/   python -m jaxray.bench: timing, mfu\n```\n"  # no shell block: a layout
    )
    got = [(c.line, c.module, c.argvs) for c in commands(text, "t")]
    assert got == [
        (1, "jaxray.tune", (("--config", "a.yaml", "--out", "DIR"),)),
        (5, "jaxray.bench", (("ingest", "--workload", "mlp"), ("ingest", "--workload", "all"))),
        (7, "jaxray.doctor", (("--json",),)),
        (7, "jaxray.generate", (("--checkpoint", "x"),)),
        (10, "jaxray.generate", (("--sampler", "kv"), ("--sampler", "full"))),
        (11, "jaxray.doctor", (("--json",),)),
        (11, "jaxray.bench", (("compile", "--json"),)),
    ]
