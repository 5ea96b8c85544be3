"""Every shell command in README.md and docs/*.md parses, as written, with the real CLI, without running.

Commands are the lines of ```bash blocks (each must be a command this file knows), and the lines of plain ```
blocks and 4-space-indented blocks that start like one (``moga``, ``python``, ``torchrun``, ``pip``, ``bash``,
after ``NAME=value`` environment settings). ``\\`` continues a line, as does an open quote; ``#`` starts a
comment; ``for V in a b; do ... done`` runs its body once per value and ``NAME="..."`` sets ``$NAME``, as in
bash; a trailing ``...`` stands for the rest of the command above it ("the same options").

What is checked without running anything:

- ``moga ...`` (and ``python -m moga.train``, ``torchrun ... -m moga.train``): each command of the chain,
  from the console script's own group (``moga.cli.command``, not ``moga.cli.app``: the two once differed on
  ``moga data fetch``), makes its click context, so an unknown command or option, a bad value or a missing
  argument fails; then a training config with its ``key=value`` overrides loads (``moga.train.load_config``,
  and the model's own keys), a sweep config builds with every cell (``Sweep.from_file``), and an executor, a
  tune budget, a reproduction and a bench record are ones the command knows;
- ``python -m MODULE``: the module imports; one with a ``USAGE`` line must name the subcommand and options
  given; ``python -m timeit``: its options parse and its code compiles, and what it imports from moga exists;
- ``python scripts/X.py``: the script compiles, and one with argparse parses the arguments (its ``main`` is
  stopped right after ``parse_args``);
- ``pip install -e ".[EXTRA]"``: each extra is in pyproject.toml; ``bash scripts/X.sh``: it exists and
  ``bash -n`` accepts it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import getopt
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
SHELL = {"bash", "sh", "shell", "console"}  # every line is a command; plain ``` blocks: the lines that look like one
ENV = re.compile(r"[A-Za-z_]\w*=\S*$")
COMMAND = re.compile(r"(?:[A-Za-z_]\w*=\S*\s+)*(?:moga|python3?|torchrun|pip|bash)(?:\s|$)")
FOR = re.compile(r"for (\w+) in (.+?);\s*do$")
ASSIGN = re.compile(r"(\w+)=(\"[^\"]*\"|'[^']*'|\S*)$")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")

# Paths that are no file of the repository: the reader's own, or what an earlier documented command writes.
# The commands parse in a scratch directory that holds the checkout's files (links) and these (empty); a
# placeholder training config's overrides are checked against the defaults.
PLACEHOLDERS = {
    "my_run.yaml",            # docs/tune.md: "moga tune my_run.yaml ...", the reader's own training config
    "runs/tune/target.yaml",  # docs/tune.md: written by `moga tune ... -o runs/tune` just above it
    "runs/depth",             # docs/sweeps.md: the sweep directory `moga sweep ... --out runs/depth` fills
    "runs/research/hybrid-gap",  # docs/results.md: the store `moga sweep ... --out runs/research/hybrid-gap` fills
    "runs/research/hybrid-gap-baselines",  # docs/results.md: likewise, the sweep just above it fills it
    "runs/research/hybrid-gap-table",  # docs/results.md: likewise
}
# `python -m MODULE ...` that stands for `moga ...` (the module runs the same click command).
MOGA_MODULES = {"moga": [], "moga.train": ["train"]}


def without_env(words: list[str]) -> list[str]:
    """The command without the environment it is given (MOGA_DATA=..., ATEN_CPU_CAPABILITY=...)."""
    while words and ENV.match(words[0]):
        words = words[1:]
    return words


def uncomment(text: str) -> tuple[str, str | None]:
    """``text`` without its ``#`` comment, and the quote left open at its end (None: none)."""
    quote = None
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), None
    return text.rstrip(), quote


def logical_lines(lines: list[tuple[int, str]], strict: bool) -> list[tuple[int, str]]:
    """(first line number, text) per command: continued across ``\\`` and open quotes, comments dropped; in a
    block that is not all commands (``strict`` False), lines that start none are left out."""
    out, buffer, start = [], "", None
    for number, text in lines:
        bare = text.strip()
        if not (buffer or strict or COMMAND.match(bare) or FOR.match(bare) or ASSIGN.match(bare) or bare == "done"):
            continue
        buffer, start = (f"{buffer} {text.strip()}" if buffer else text.strip()), start or number
        code, quote = uncomment(buffer)
        if quote:
            continue
        if code.endswith("\\"):
            buffer = code[:-1].rstrip()
            continue
        out.append((start, code))
        buffer, start = "", None
    assert not buffer, f"line {start}: a command that never ends (a trailing \\ or an open quote)"
    return out


def block_commands(lines: list[tuple[int, str]], strict: bool) -> list[tuple[str, list[str]]]:
    """(suffix of the id, words) per command of one block, loops unrolled and variables expanded."""
    found, variables, loop = [], {}, None

    def emit(number: int, text: str, values: dict, suffix: str = ""):
        if not (strict or COMMAND.match(text)):
            return
        words = shlex.split(VARIABLE.sub(lambda m: values.get(m[1], m[0]), text))
        if words[-1] == "..." and found:  # "the same options" as the command above
            head, before = without_env(words)[:-1], without_env(found[-1][1])
            if before[:len(head)] == head:
                words = [*words[:-1], *before[len(head):]]
        found.append((f"{number}{suffix}", words))

    for number, text in logical_lines(lines, strict):
        if not text:
            continue
        if match := FOR.match(text):
            loop = (match[1], shlex.split(match[2]), [])
        elif text == "done" and loop:
            name, values, body = loop
            for value in values:
                for n, t in body:
                    emit(n, t, {**variables, name: value}, f"[{name}={value}]")
            loop = None
        elif loop:
            loop[2].append((number, text))
        elif match := ASSIGN.match(text):
            variables[match[1]] = shlex.split(match[2])[0] if match[2] else ""
        else:
            emit(number, text, variables)
    return found


def doc_commands() -> list[tuple[str, list[str]]]:
    """("file:line", words) for every documented command, in file order."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        blocks, fenced = [], set()
        for match in FENCE.finditer(text):
            first = text.count("\n", 0, match.start()) + 1  # the ``` line, 1-based
            last = text.count("\n", 0, match.end()) + 1
            fenced.update(range(first, last + 1))
            if match["lang"] in SHELL or not match["lang"]:
                indent = len(match["indent"])
                blocks.append(([(n, lines[n - 1][indent:]) for n in range(first + 1, last)], match["lang"] in SHELL))
        n = 1
        while n <= len(lines):  # indented blocks: 4 spaces, after a blank line, outside fences
            if n not in fenced and lines[n - 1].startswith("    ") and (n == 1 or not lines[n - 2].strip()):
                block = []
                while n <= len(lines) and lines[n - 1].startswith("    ") and n not in fenced:
                    block.append((n, lines[n - 1]))
                    n += 1
                indent = len(block[0][1]) - len(block[0][1].lstrip())  # a list item's block sits deeper
                if COMMAND.match(block[0][1][indent:]):
                    blocks.append(([(k, t[indent:]) for k, t in block], False))
                continue
            n += 1
        rel = path.relative_to(REPO)
        for block, strict in sorted(blocks, key=lambda b: b[0][0][0] if b[0] else 0):
            try:
                found += [(f"{rel}:{suffix}", words) for suffix, words in block_commands(block, strict)]
            except AssertionError as e:
                raise AssertionError(f"{rel}: {e}") from None
    return found


COMMANDS = doc_commands()


# --- the checks -------------------------------------------------------------------------------------------

def check(words: list[str]) -> None:
    words = without_env(words)
    assert "..." not in words, "a `...` must end a command that repeats the start of the one above it"
    head, args = words[0], words[1:]
    if head == "moga":
        check_moga(args)
    elif head in ("python", "python3") and args[:1] == ["-m"] and len(args) > 1:
        check_module(args[1], args[2:])
    elif head in ("python", "python3") and args and args[0].endswith(".py"):
        check_script(args[0], args[1:])
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser
        parsed = argparse_parse(get_args_parser(), args)
        assert parsed.module, "torchrun runs a module here: give -m"
        check_module(parsed.training_script, parsed.training_script_args)
    elif head == "pip" and args[:1] == ["install"]:
        check_pip(args[1:])
    elif head == "bash" and len(args) >= 1:
        script = REPO / args[0]
        assert script.is_file(), f"no script {args[0]} in the repository"
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    else:
        raise AssertionError("a command this test does not know: teach it tests/test_doc_commands.py")


def check_moga(args: list[str]) -> None:
    from moga.cli import command
    chain, cmd, ctx = [], command, command.make_context("moga", list(args))
    while hasattr(cmd, "resolve_command"):  # a group: on to its subcommand, as click's Group.invoke does
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            ctx.fail("Missing command.")
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        chain.append(name)
        ctx = cmd.make_context(name, rest, parent=ctx)
    check_values(" ".join(chain), ctx.params)


def check_values(chain: str, params: dict) -> None:
    """What the commands check once they run: configs, executors, durations, reproduction and record names."""
    if params.get("executor") is not None:
        from moga.sweep.executor import EXECUTORS
        assert params["executor"] in EXECUTORS, f"no executor {params['executor']!r}; they are {list(EXECUTORS)}"
    if chain in ("train", "lr-range", "tune"):
        check_config(params["config"], params["overrides"] or [])
    if chain == "tune":
        from moga.experiments.tune.cli import parse_duration, parse_sizes
        if params["budget_time"] is not None:
            parse_duration(params["budget_time"])
        parse_sizes(params["proxies"])
    elif chain == "sweep" and params["target"] != "status":
        from moga.sweep.spec import Sweep
        Sweep.from_file(repo_file(params["target"]))
    elif chain == "reproduce" and params["name"] not in (None, "all"):
        from moga.experiments.reproduce.catalog import get
        get(params["name"])
    elif chain in ("bench optimizer", "bench distributed"):  # each bench has its own records
        records = importlib.import_module(f"moga.bench.{chain.split()[1]}").OPTIMIZERS
        unknown = sorted(set(params["only"] or ()) - set(records))
        assert not unknown, f"no {chain} records {unknown}; they are {sorted(records)}"


def check_config(config, overrides: list[str]) -> None:
    from moga.train import load_config
    if config is None or str(config) in PLACEHOLDERS:  # the defaults, with the one key they leave to a config
        load_config(None, ["train.steps=1", *overrides])
    else:  # and the model's own keys against its constructor, as a sweep checks each cell
        from moga.train.build import model_kwargs
        model_kwargs(load_config(repo_file(config), overrides))


def repo_file(path) -> Path:
    found = REPO / path
    assert found.is_file(), f"no {path} in the repository (if the reader makes it, add it to PLACEHOLDERS)"
    return found


def check_module(name: str, args: list[str]) -> None:
    if name in MOGA_MODULES:
        return check_moga([*MOGA_MODULES[name], *args])
    if name == "timeit":
        return check_timeit(args)
    assert importlib.util.find_spec(name) is not None, f"no module {name}"
    usage = getattr(importlib.import_module(name), "USAGE", None)
    if usage is not None:  # a hand-parsed command line: its usage names what it takes
        words = set(re.findall(r"--?[\w-]+|\w[\w-]*", usage))
        named = [a for a in args[:1] + [a for a in args if a.startswith("-")] if a not in words]
        assert not named, f"{name}'s USAGE names no {named}:\n{usage}"


def check_timeit(args: list[str]) -> None:
    options, statements = getopt.getopt(args, "n:u:s:r:pvh",  # as timeit.main reads them
                                        ["number=", "setup=", "repeat=", "process", "verbose", "unit=", "help"])
    for code in [v for k, v in options if k in ("-s", "--setup")] + statements:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "moga":
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{node.module} has no {missing}"


class Parsed(Exception):
    pass


def check_script(path: str, args: list[str]) -> None:
    source = repo_file(path).read_text(encoding="utf-8")
    compile(source, path, "exec")
    if "argparse" not in source:
        return
    spec = importlib.util.spec_from_file_location(f"doc_script_{Path(path).stem}", REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    argv, sys.argv = sys.argv, [path, *args]
    argparse.ArgumentParser.parse_args = parse_only
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            module.main()
    except Parsed:
        return
    except SystemExit:
        raise AssertionError(f"{path} refuses the arguments:\n{err.getvalue()}") from None
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = argv, original
    raise AssertionError(f"{path}: main() returned without parsing arguments")


def argparse_parse(parser: argparse.ArgumentParser, args: list[str]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        raise AssertionError(err.getvalue()) from None


def check_pip(args: list[str]) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    targets = [a for a in args if a != "-e"]
    assert targets and all(re.fullmatch(r"\.(\[[\w,-]+\])?", t) for t in targets), "pip installs this checkout only"
    for target in targets:
        unknown = [e for e in re.findall(r"[\w-]+", target) if e not in extras]
        assert not unknown, f"no extras {unknown} in pyproject.toml; they are {sorted(extras)}"


def test_the_docs_have_commands():
    per_file = {}
    for where, _ in COMMANDS:
        per_file[where.split(":")[0]] = per_file.get(where.split(":")[0], 0) + 1
    assert len(COMMANDS) >= 50 and len(per_file) >= 7, per_file
    assert len({where for where, _ in COMMANDS}) == len(COMMANDS), "two commands with one id"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The checkout's top-level entries (links) and the placeholders' paths (empty)."""
    root = tmp_path_factory.mktemp("doc-commands")
    outputs = {Path(p).parts[0] for p in PLACEHOLDERS}  # made here, never inside the checkout (runs/ may be there)
    for entry in REPO.iterdir():
        if entry.name not in outputs:
            (root / entry.name).symlink_to(entry)
    for placeholder in map(Path, PLACEHOLDERS):
        (root / placeholder.parent).mkdir(parents=True, exist_ok=True)
        (root / placeholder).touch() if placeholder.suffix else (root / placeholder).mkdir()
    return root


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_doc_command_parses(where, words, scratch, monkeypatch):
    monkeypatch.chdir(scratch)
    try:
        check(words)
    except Exception as e:  # click's usage errors, config errors, assertions: all name the command
        message = getattr(e, "format_message", lambda: str(e))()
        pytest.fail(f"{where}: {shlex.join(words)}\n{type(e).__name__}: {message}", pytrace=False)
