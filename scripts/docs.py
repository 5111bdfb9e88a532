"""README.md and docs/*.md: their generated parts, and their runnable examples.

    python scripts/docs.py generate                 # rewrite every generated region from the code
    python scripts/docs.py check                    # exit 1 naming each stale generated region
    python scripts/docs.py outputs [--slow] [PAGE]  # run the examples, write their sample outputs

What a page may hold (tests/unit/test_docs.py checks all of it):

- ``<!-- generated: NAME ARGS -->`` ... ``<!-- end: NAME -->``: a region written by ``GENERATORS[NAME]``
  from the code (the config's fields, the CLI's help, the model families, ...). Never edit one by hand:
  change the code, run ``generate``.
- a fenced block ```` ```sh run ````: an example the test suite runs (CPU, small sizes), in order, in a
  scratch directory laid out as a checkout (``configs/`` and ``benchmarks/`` linked, ``../shared``
  beside it); ```` ```sh sample ````: an example too slow for the suite, run here with ``--slow``.
- ``<!-- expect: TEXT -->`` lines right after such a block: text its output must contain (a fresh
  run's in the test, and the sample output's).
- a ```` ```text output ```` block right after (expect lines between): the block's sample output,
  written by ``outputs`` from a real run, never by hand.

Every ``harmonia`` command in any shell block (run, sample or plain) is parsed by the test against
the CLI and the config's fields, so a renamed flag or field fails until the docs follow.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
HELP_COLUMNS = "100"
"""Width the CLI's ``--help`` is generated at (argparse reads ``COLUMNS``)."""


def pages() -> list[Path]:
    """Every page: README.md, then docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---------------------------------------------------------------------------------------------
# Blocks and regions


@dataclass
class Block:
    """A fenced block: its info string (``sh run``), its lines in the page, its text."""

    info: str
    start: int  # the opening fence's line index
    end: int  # the closing fence's line index
    text: str
    expects: list[str] = field(default_factory=list)
    output: Block | None = None

    @property
    def kind(self) -> str:
        """``run``, ``sample``, ``output``, ``shell`` (any other sh/bash/console block) or ``other``."""
        words = self.info.split()
        lang = words[0] if words else ""
        if lang in ("sh", "bash", "shell", "console"):
            return words[1] if len(words) > 1 and words[1] in ("run", "sample") else "shell"
        return "output" if words[1:2] == ["output"] else "other"


FENCE = re.compile(r"^(```+)(.*)$")
EXPECT = re.compile(r"^<!-- expect: (.*) -->$")


def parse_blocks(text: str) -> list[Block]:
    """The page's fenced blocks, each runnable one with its expect lines and sample output."""
    lines = text.split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != m.group(1):
            j += 1
        found.append(Block(m.group(2).strip(), i, j, "\n".join(lines[i + 1:j])))
        i = j + 1
    for k, block in enumerate(found):
        if block.kind not in ("run", "sample"):
            continue
        line = block.end + 1
        while line < len(lines) and (not lines[line].strip() or EXPECT.match(lines[line].strip())):
            m = EXPECT.match(lines[line].strip())
            if m:
                block.expects.append(m.group(1))
            line += 1
        nxt = found[k + 1] if k + 1 < len(found) else None
        if nxt is not None and nxt.start == line and nxt.kind == "output":
            block.output = nxt
    return found


REGION = re.compile(r"^<!-- generated: (\S+)(.*?) -->$")


def regions(text: str) -> list[tuple[str, str, int, int]]:
    """``(name, args, start, end)`` of each generated region: its marker lines' indices."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = REGION.match(line.strip())
        if m:
            name = m.group(1)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == f"<!-- end: {name} -->"), None)
            if end is None:
                raise SystemExit(f"a generated region {name} has no '<!-- end: {name} -->'")
            out.append((name, m.group(2).strip(), i, end))
    return out


def regenerate(text: str) -> str:
    """The page with every generated region rewritten."""
    lines = text.split("\n")
    for name, args, start, end in reversed(regions(text)):
        if name not in GENERATORS:
            raise SystemExit(f"unknown generated region {name!r}; known: {sorted(GENERATORS)}")
        body = GENERATORS[name](args).strip("\n").split("\n")
        lines[start + 1:end] = body
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Generators: each returns the Markdown of one region


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def gen_config(args: str) -> str:
    """Every config section and field: default and help, from `harmonia.config`'s dataclasses."""
    from harmonia.config import config_fields

    out, section = [], None
    for name, default, text in config_fields():
        sec, key = name.split(".")
        if sec != section:
            section = sec
            out += ["", f"#### `[{sec}]`", "", "| field | default | what it is |", "| --- | --- | --- |"]
        out.append(f"| `{key}` | `{_toml(default)}` | {_cell(text)} |")
    return "\n".join(out[1:])


def gen_families(args: str) -> str:
    """The HF checkpoint families: model_type read or refused (`harmonia.model.families.FAMILIES`)."""
    from harmonia.model.families import FAMILIES

    out = ["| `model_type` | status |", "| --- | --- |"]
    for kind in FAMILIES.supported():
        family = FAMILIES._by_type[kind]
        what = "read (an LLM alone: no encoders)" if not family.multimodal else f"read ({family.name})"
        out.append(f"| `{kind}` | {what} |")
    for kind, what in sorted(FAMILIES._refused.items()):
        out.append(f"| `{kind}` | refused by name: {_cell(what)} |")
    return "\n".join(out)


def _help(command: str) -> str:
    from harmonia.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return sub.choices[command].format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def gen_cli(args: str) -> str:
    """``harmonia COMMAND --help``, as it prints at 100 columns."""
    return "```text\n" + _help(args).rstrip() + "\n```"


def gen_job_flags(args: str) -> str:
    """The flags `plan` and `simulate` share with `train`, each a config field's override."""
    from harmonia.cli.job import JOB_FLAGS
    from harmonia.config import ModelConfig, config_fields

    defaults = {name: default for name, default, _ in config_fields()}
    out = ["| flag | config field it sets | default |", "| --- | --- | --- |",
           f"| `--model` | `model.preset`, or `model.hf` for a checkpoint directory | `{ModelConfig().source}` |"]
    for flag, name in JOB_FLAGS.items():
        default = defaults[name]
        if name == "parallel.cluster":
            shown = "`cpu:1xN`, N = `parallel.world_size` (4)"
        elif name == "model.frozen":
            shown = f"`{','.join(default)}`, where the model has it"
        else:
            shown = f"`{_toml(default)}`"
        where = " (`simulate`, with `--layout`)" if flag == "schedule" else ""
        out.append(f"| `--{flag.replace('_', '-')}`{where} | `{name}` | {shown} |")
    return "\n".join(out)


def gen_packages(args: str) -> str:
    """The package dependency order `tests/unit/test_imports.py` enforces."""
    sys.path.insert(0, str(ROOT))
    try:
        from tests.unit.test_imports import ALLOWED, CHAIN
    finally:
        sys.path.remove(str(ROOT))
    order = [*CHAIN, "data", "config", "launch", "metrics", "cli"]
    out = ["| package | may import (besides `errors`) |", "| --- | --- |"]
    for name in order:
        allowed = sorted(ALLOWED[name], key=lambda p: order.index(p) if p in order else len(order))
        out.append(f"| `{name}` | {', '.join(f'`{p}`' for p in allowed) or 'nothing of harmonia'} |")
    return "\n".join(out)


def gen_names(args: str) -> str:
    """The names listed once in the code, and where; every other place imports them."""
    from harmonia.config import LR_SCHEDULES
    from harmonia.data.formats import FORMATS
    from harmonia.model.presets import ENCODERS, LLMS, MLLM_PRESETS
    from harmonia.plan.recipes import RECIPES
    from harmonia.schedule.generators import FAMILIES

    rows = [
        ("schedule families", "harmonia.schedule.generators.FAMILIES", FAMILIES),
        ("recipes", "harmonia.plan.recipes.RECIPES", RECIPES),
        ("MLLM presets (and LLMs alone)", "harmonia.model.presets.MLLM_PRESETS", tuple(MLLM_PRESETS)),
        ("LLM presets", "harmonia.model.presets.LLMS", tuple(LLMS)),
        ("encoder presets", "harmonia.model.presets.ENCODERS", tuple(ENCODERS)),
        ("data formats", "harmonia.data.formats.FORMATS", FORMATS),
        ("learning-rate schedules", "harmonia.config.LR_SCHEDULES", LR_SCHEDULES),
    ]
    out = ["| names | listed in | values |", "| --- | --- | --- |"]
    out += [f"| {what} | `{where}` | {', '.join(f'`{v}`' for v in values)} |" for what, where, values in rows]
    return "\n".join(out)


def _attributes(doc: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style docstring's ``Attributes:`` section."""
    out: dict[str, str] = {}
    lines = doc.split("\n")
    try:
        i = next(k for k, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    current = None
    for line in lines[i + 1:]:
        if not line.strip():
            break
        m = re.match(r"^ {4}(\w+): (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current is not None:
            out[current] += " " + line.strip()
    return out


def gen_schema(args: str) -> str:
    """The fields of a dataclass (``module.Class``) with their types and documented meaning."""
    import importlib

    module, _, name = args.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    doc = _attributes(inspect.cleandoc(cls.__doc__ or ""))
    out = ["| key | type | default | what it is |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        shown = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING \
            else f"`{json.dumps(default.value if hasattr(default, 'value') else default)}`"
        kind = str(f.type).replace("|", "or")
        out.append(f"| `{f.name}` | `{kind}` | {shown} | {_cell(doc.get(f.name, ''))} |")
    return "\n".join(out)


def gen_docstring(args: str) -> str:
    """A module's docstring (``harmonia.workload.cost``), as Markdown: the derivations it carries."""
    path = ROOT / (args.replace(".", "/") + ".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return f"From `{args}` ([source](../{path.relative_to(ROOT)})):\n\n" + doc.strip()


GENERATORS = {
    "config": gen_config,
    "families": gen_families,
    "cli": gen_cli,
    "job-flags": gen_job_flags,
    "packages": gen_packages,
    "names": gen_names,
    "schema": gen_schema,
    "docstring": gen_docstring,
}


# ---------------------------------------------------------------------------------------------
# Running the examples


def scratch(base: Path) -> Path:
    """A directory laid out as a checkout under ``base`` (``configs/``, ``benchmarks/`` linked,
    ``../shared`` beside it): where a page's examples run, so they write nothing into the checkout."""
    work = base / "checkout"
    work.mkdir(parents=True, exist_ok=True)
    for name in ("configs", "benchmarks"):
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    if SHARED.is_dir() and not (base / "shared").exists():
        (base / "shared").symlink_to(SHARED)
    return work


def environment() -> dict[str, str]:
    """The examples' environment: this interpreter's ``harmonia`` first on PATH, no colours."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": HELP_COLUMNS, "PYTHONUNBUFFERED": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1"})  # transformers' loading bars are no output of ours
    return env


def run_block(block: Block, cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """Run a block's text with bash (``-e -o pipefail``) in ``cwd``: exit code and its output with
    the scratch and checkout paths written as a reader's checkout would print them."""
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=cwd, env=environment(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    out = done.stdout
    for path, shown in ((SHARED.resolve(), "../shared"), (cwd.parent / "shared", "../shared"), (cwd, "."),
                        (ROOT, ".")):
        out = out.replace(str(path) + "/", shown + "/").replace(str(path), shown)
    return done.returncode, "\n".join(line.rstrip() for line in out.strip("\n").rstrip().split("\n"))


def missing_expects(block: Block, output: str) -> list[str]:
    """The block's expect lines its output lacks (whitespace runs compared as one space)."""
    flat = " ".join(output.split())
    return [e for e in block.expects if " ".join(e.split()) not in flat]


def write_outputs(page: Path, base: Path, slow: bool) -> None:
    """Run the page's examples in order and write each one's sample output block."""
    work = scratch(base / page.stem)
    examples = [b for b in parse_blocks(page.read_text()) if b.kind in ("run", "sample")]
    for k, block in enumerate(examples):
        if block.kind == "sample" and not slow:
            print(f"{page.name}: skipping a sample block (--slow runs it)")
            continue
        print(f"{page.name}: {block.text.splitlines()[0]}", flush=True)
        rc, out = run_block(block, work, timeout=1800)
        if rc != 0:
            raise SystemExit(f"{page.name}: the block at line {block.start + 1} failed ({rc}):\n{out}")
        if missing_expects(block, out):
            raise SystemExit(f"{page.name}: the block at line {block.start + 1} lacks {missing_expects(block, out)}")
        if block.output is not None:  # earlier writes moved the lines: find the k-th example again
            text = page.read_text()
            target = [b for b in parse_blocks(text) if b.kind in ("run", "sample")][k].output
            lines = text.split("\n")
            lines[target.start + 1:target.end] = out.split("\n")
            page.write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Commands in shell blocks


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block: backslash-continued lines joined, comments dropped, split
    on ``&&`` and ``;``, each as its words."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.split("\n"):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        command: list[str] = []
        for word in words + [";"]:
            if word in ("&&", ";", "||", "|"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def harmonia_args(words: list[str]) -> list[str] | None:
    """The arguments after ``harmonia`` (or ``python -m harmonia``, ``torchrun ... -m harmonia``), or
    None for another command."""
    if words and Path(words[0]).name == "harmonia":
        return words[1:]
    if "-m" in words:
        i = words.index("-m")
        if i + 1 < len(words) and words[i + 1] == "harmonia":
            return words[i + 2:]
    return None


def check_command(args: list[str]) -> str | None:
    """Why ``harmonia ARGS`` would not parse (an unknown subcommand, flag or config field), or None.
    Values are not checked (paths may not exist where the docs are read)."""
    from harmonia.cli import build_parser
    from harmonia.config import config_fields

    if not args or args[0] in ("-h", "--help") or "--help" in args:
        return None
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    if args[0] not in sub.choices:
        return f"unknown subcommand {args[0]!r}"
    if "..." in args:
        args = args[: args.index("...")]
    if args[0] in ("hf", "data"):  # the rest is the tool's own (its --help)
        from harmonia.cli import DATA_TOOLS, HF_TOOLS

        tools = HF_TOOLS if args[0] == "hf" else DATA_TOOLS
        return None if len(args) < 2 or args[1] in tools else f"unknown tool {args[1]!r}"
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            _, extra = parser.parse_known_args(args)
    except SystemExit:
        return err.getvalue().strip().split("\n")[-1] if err.getvalue() else "does not parse"
    fields_known = {name for name, _, _ in config_fields()}
    for item in extra:
        key = item.removeprefix("--").partition("=")[0]
        if args[0] not in ("train", "demo", "plan", "simulate") or key not in fields_known:
            return f"unknown argument {item!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="rewrite every generated region")
    sub.add_parser("check", help="exit 1 when a generated region is stale")
    p = sub.add_parser("outputs", help="run the examples and write their sample outputs")
    p.add_argument("--slow", action="store_true", help="also the sample blocks (minutes)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("pages", nargs="*", help="pages (default: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.command == "generate":
        for page in pages():
            text = page.read_text()
            new = regenerate(text)
            if new != text:
                page.write_text(new)
                print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    if args.command == "check":
        stale = [str(p.relative_to(ROOT)) for p in pages() if regenerate(p.read_text()) != p.read_text()]
        for name in stale:
            print(f"{name}: generated regions are stale; run python scripts/docs.py generate")
        return 1 if stale else 0
    import tempfile

    chosen = [Path(p).resolve() for p in args.pages] or pages()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.dir) if args.dir else Path(tmp)
        for page in chosen:
            write_outputs(page, base, args.slow)
    return 0


if __name__ == "__main__":
    sys.exit(main())
