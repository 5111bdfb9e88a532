"""README.md and docs/ against the code: generated regions current, examples run, commands parse,
figures from the results files, links that resolve (conventions: `scripts/docs.py`, docs/docs.md)."""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_docs_script():
    spec = importlib.util.spec_from_file_location("harmonia_docs_script", ROOT / "scripts" / "docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


docs = _load_docs_script()
PAGES = docs.pages()
EXAMPLE_PAGES = [p for p in PAGES if any(b.kind == "run" for b in docs.parse_blocks(p.read_text()))]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_generated_regions_are_current(page: Path) -> None:
    text = page.read_text()
    fresh = docs.regenerate(text)
    diff = "\n".join(difflib.unified_diff(text.split("\n"), fresh.split("\n"), "on disk", "generated", n=1,
                                          lineterm=""))
    assert fresh == text, f"{_name(page)}: run `python scripts/docs.py generate`\n{diff[:3000]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=_name)
def test_examples_run_and_print_what_they_say(page: Path, tmp_path: Path) -> None:
    """Every ``sh run`` block of the page, in order, in a scratch checkout: exit code 0, and every
    expect line in its output and in its committed sample output."""
    work = docs.scratch(tmp_path)
    for block in docs.parse_blocks(page.read_text()):
        if block.kind != "run":
            continue
        where = f"{_name(page)}:{block.start + 1}"
        code, out = docs.run_block(block, work, timeout=300)
        assert code == 0, f"{where} exited with {code}:\n{out[-3000:]}"
        assert not docs.missing_expects(block, out), f"{where} lacks {docs.missing_expects(block, out)}:\n{out[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_sample_outputs_are_written_and_show_the_expected_lines(page: Path) -> None:
    for block in docs.parse_blocks(page.read_text()):
        if block.kind not in ("run", "sample"):
            continue
        where = f"{_name(page)}:{block.start + 1}"
        if block.kind == "sample":
            assert block.expects, f"{where}: a sample block says what its output shows (expect lines)"
        if block.output is not None:
            assert block.output.text.strip(), f"{where}: run `python scripts/docs.py outputs --slow {_name(page)}`"
            missing = docs.missing_expects(block, block.output.text)
            assert not missing, f"{where}: the sample output lacks {missing}; regenerate it"


def test_every_command_in_the_docs_parses() -> None:
    """Each ``harmonia ...`` line of every shell block, against the CLI's parser and the config's fields."""
    problems, seen = [], 0
    for page in PAGES:
        for block in docs.parse_blocks(page.read_text()):
            if block.kind not in ("run", "sample", "shell"):
                continue
            for words in docs.shell_commands(block.text):
                args = docs.harmonia_args(words)
                if args is None:
                    continue
                seen += 1
                why = docs.check_command(args)
                if why:
                    problems.append(f"{_name(page)}:{block.start + 1}: harmonia {' '.join(args)}: {why}")
    assert seen > 20
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_renamed_flags_and_fields() -> None:
    ok = [["plan", "--global-batch", "8"], ["train", "--config", "job.toml", "--train.steps=3"],
          ["plan", "--config", "job.toml", "--parallel.llm_pp=2"], ["simulate", "..."],
          ["data", "inspect", "DATASET"], ["hf", "tiny-llava", "out"]]
    for args in ok:
        assert docs.check_command(args) is None, args
    bad = [["plan", "--globl-batch", "8"], ["train", "--train.stepz=3"], ["train", "--nosuch.section=1"],
           ["plam"], ["data", "inspekt", "x"], ["export", "--checkpoint", "c", "--out", "o", "--dtype", "int3"],
           ["workload", "--train.steps=3"]]
    for args in bad:
        assert docs.check_command(args) is not None, args
    assert docs.harmonia_args(["torchrun", "--nnodes", "2", "-m", "harmonia", "train"]) == ["train"]
    assert docs.shell_commands("a --x \\\n  --y  # note\nb && harmonia models") == [["a", "--x", "--y"], ["b"],
                                                                                   ["harmonia", "models"]]


NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")
RESULTS_LINK = re.compile(r"\]\(([^)\s]*benchmarks/results/[^)\s#]+)\)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def _units(text: str) -> list[str]:
    """Paragraphs and table rows, outside fenced blocks."""
    units, paragraph, fenced = [], [], False
    for line in text.split("\n") + [""]:
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("|"):
            units.append(line)
        elif line.strip():
            paragraph.append(line)
            continue
        if paragraph:
            units.append(" ".join(paragraph))
            paragraph = []
    return units


def test_figures_quoted_beside_a_results_link_are_in_that_file() -> None:
    problems, checked = [], 0
    for page in PAGES:
        for unit in _units(page.read_text()):
            links = RESULTS_LINK.findall(unit)
            if not links:
                continue
            sources = []
            for link in links:
                path = (page.parent / link).resolve()
                assert path.is_file(), f"{_name(page)}: {link} does not exist"
                sources.append(path.read_text())
            for number in NUMBER.findall(LINK_TARGET.sub("]", unit)):
                checked += 1
                if not any(number in text for text in sources):
                    problems.append(f"{_name(page)}: {number} is in none of {links}: {unit[:120]}...")
    assert checked > 100
    assert not problems, "\n".join(problems)


def test_the_figure_check_reads_numbers_as_written() -> None:
    assert NUMBER.findall("10,153-10,682 tok/s, +0.0% / -5.0%, llm tp2 cp4, Qwen2.5-72B, 1.32x-4.12x") == [
        "10,153", "10,682", "0.0", "5.0", "72", "1.32", "4.12"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_point_at_files_and_headings_that_exist() -> None:
    problems = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{_name(page)}: {target} does not exist")
                continue
            if anchor and file.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
                if anchor not in headings:
                    problems.append(f"{_name(page)}: no heading #{anchor} in {path or page.name}")
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_every_page_is_linked_from_it() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12 * 1024
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md links no docs/{page.name}"
