"""The documents a user reads (README.md, examples/README.md and docs/**/*.md) say what is true now and
point at files that exist.

* No history words: the story of how something was found (which session, which CI
  run, which issue, "before this change") belongs in ``git log`` and CHANGELOG.md.
* The same in the source a reader of the code meets (hvd_compress/, scripts/,
  examples/: code, comments, docstrings, tool output), where "the issue" (the
  task that asked for a thing) counts too.  Tests may name the bug they guard.
* Every relative link ``[text](path)`` / ``![alt](path)`` resolves to a file or folder,
  and its ``#anchor``, if any, to a heading of that page (GitHub's slugs).
* Every ``docs/....md`` path that a source file, script, test or document names exists
  (a moved document leaves no stale pointer behind).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: phrases that tell a story instead of stating what is true
HISTORY = re.compile(
    r"\bsessions? \d+"            # "session 15", "sessions 12"
    r"|\bsession's machine"
    r"|\bCI stops?\b"
    r"|\bstops? \d{2}\b"          # "stop 25", "Stops 17-23"
    r"|\bissues? #?\d+"           # "issue #12", "issue 16"
    r"|\b(?:before|after) this change",
    re.IGNORECASE)

#: [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w-][\w./-]*?\.md\b")


def user_documents():
    return [REPO / "README.md", REPO / "examples" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def history_words(text: str):
    """(line number, phrase) for each history phrase in ``text``."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in HISTORY.finditer(line)]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(path: Path):
    """The anchors GitHub gives the headings of the markdown file ``path``: lower case,
    punctuation dropped, spaces as hyphens, a repeated slug suffixed -1, -2, ..."""
    seen, out = {}, set()
    for line in _without_code_blocks(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path):
    """The relative link targets in the markdown file ``path`` that name no existing path,
    or an anchor that no heading of the markdown page it names has."""
    text = _without_code_blocks(path.read_text(encoding="utf-8"))  # code blocks hold no links
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # a URL (http:, mailto:)
        file_part, _, anchor = target.partition("#")
        page = (path.parent / file_part) if file_part else path
        if not page.exists():
            broken.append(target)
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(target)
    return broken


def test_history_words_are_found():
    sample = ("Measured on session 15's machine.\nCI stop 25 failed; Stops 17-23 took 30 min.\n"
              "See issue #12 and issue 16.\nBefore this change it was slow.\nthe session's machine\n")
    found = [w.lower() for _, w in history_words(sample)]
    assert found == ["session 15", "ci stop", "stops 17", "issue #12", "issue 16", "before this change",
                     "session's machine"]
    # what is true now passes
    assert history_words("Random-K at 1% needs ~1/ratio steps to deliver a coordinate (the ratio sweep). "
                         "Each step stops 3 ranks; the session ends; a sessionless test.") == []


@pytest.mark.parametrize("doc", user_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_words(doc):
    found = history_words(doc.read_text(encoding="utf-8"))
    assert not found, f"{doc.relative_to(REPO)} tells history (move it to CHANGELOG.md or git log): {found}"


#: in source, "the issue" is the task that asked for a thing: history as well
SOURCE_HISTORY = re.compile(r"\b(?:the|this) issue(?:'s)?\b", re.IGNORECASE)
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".h", ".sh")


def source_files():
    """The library, the scripts, the examples, the tests and the docker files, in the
    languages they are written in.  This file is left out: its samples are history words."""
    files = [p for p in (REPO / "hvd_compress").rglob("*") if p.suffix in SOURCE_SUFFIXES]
    files += [p for p in (REPO / "scripts").iterdir() if p.suffix in SOURCE_SUFFIXES]
    files += list((REPO / "examples").glob("*.py"))
    files += [p for p in (REPO / "tests").rglob("*") if p.suffix in SOURCE_SUFFIXES
              and p != Path(__file__).resolve() and "__pycache__" not in p.parts]
    files += [p for p in (REPO / "docker").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES + ("", ".yaml")]
    return sorted(files)


def source_history_words(text: str):
    return sorted(history_words(text) + [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
                                         for m in SOURCE_HISTORY.finditer(line)])


def test_history_words_in_source_are_found():
    sample = ("# 12 ms -> 3 ms in session 14\nx = 1  # the issue's target\n"
              "    help='the issue allows 8 minutes'\n# slow since stop 31, fixed in CI stop 32\n")
    assert [w.lower() for _, w in source_history_words(sample)] == [
        "session 14", "the issue's", "the issue", "ci stop", "stop 31"]
    assert source_history_words("# tissue; a reissue; issues every collective; stop the session\n") == []


def test_no_history_words_in_source():
    files = source_files()
    assert len([p for p in files if p.suffix == ".py"]) > 80 and any(p.suffix == ".c" for p in files)
    found = {str(p.relative_to(REPO)): words for p in files
             if (words := source_history_words(p.read_text(encoding="utf-8")))}
    assert not found, f"source tells history (move it to CHANGELOG.md or git log; keep the why): {found}"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# A title\n## `Auto()`: per tensor, online\n## A title\n")
    (tmp_path / "sub").mkdir()
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](there.md#a-title-1) [code heading](there.md#auto-per-tensor-online) [dir](sub/) "
                    "[web](https://example.org/x.md#z) [anchor](#top)\n"
                    "![gone](missing.png) [gone too](sub/nope.md#b) [no such heading](there.md#b) [here](#nope)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.png", "sub/nope.md#b", "there.md#b", "#nope"]


@pytest.mark.parametrize("doc", user_documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    assert broken_links(doc) == [], f"{doc.relative_to(REPO)}: links to paths that do not exist"


def test_named_docs_paths_exist():
    """Every ``docs/<...>.md`` that a tracked text file names (code comments, scripts,
    tests, documents) is a file in the repository."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    missing = {}
    for name in files:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".sh", ".cfg", ".toml", ".c", ".cc", ".h", ".yaml", ".yml", ""} \
                or not path.is_file() or name == "CHANGELOG.md":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for m in DOC_PATH.finditer(text):
            if not (REPO / m.group(0)).is_file():
                missing.setdefault(m.group(0), []).append(name)
    assert not missing, f"named documents that do not exist: {missing}"


def test_readme_time_to_accuracy_table_is_tta_json():
    """Every cell of README's time-to-dense-accuracy table is ``bench tta``'s speedup of that
    model, framework, scheme and link in docs/results/tta.json (4 ranks), as its report writes it."""
    import json
    from hvd_compress.tools.bench import tta
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = text[text.index("**Time to dense accuracy**"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    links = {"1 Gbit/s-like": "1gbit", "10 Gbit/s-like": "10gbit", "unshaped": "unshaped"}
    header = [links.get(c.strip(), c.strip()) for c in lines[start].strip("|").split("|")]
    cells = {(c["framework"], c["model"], c["scheme"], c["link"]): c
             for c in tta.speedups(json.loads((REPO / "docs/results/tta.json").read_text())) if c["workers"] == 4}
    checked, model = 0, None
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = [c.strip().replace("**", "") for c in line.strip("|").split("|")]
        model = re.search(r"`(\w+) (\w+)`", row[0]).groups() if row[0] else model
        scheme = re.search(r"`([^`]+)`", row[1]).group(1)
        for link, cell in zip(header[2:], row[2:]):
            c = cells.get((*model, scheme, link))
            if c is None:
                want = "not run"
            elif c["time_s"] is None:
                want = f"not reached ({c['reached']}/{c['seeds']} seeds)"
            else:
                want = " / ".join("-" if v is None else f"{v:.2f}x" for v in (c["vs_none"], c["vs_hvd_fp16"]))
            assert cell == want, (model, scheme, link, cell, want)
            checked += 1
    assert checked >= 18, checked


def _readme_e2e_table():
    """The rows of README's end-to-end table: {link label: {column: cell}}."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = text[text.index("**End to end**"):].splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| link |"))
    header = [c.strip().strip("`") for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


def test_readme_e2e_table_is_the_results_file_it_names():
    """Every cell of README's end-to-end table is the committed results file its paragraph
    names (the first docs/results/*.json path after "**End to end**"), rounded."""
    import json
    text = (REPO / "README.md").read_text(encoding="utf-8")
    source = re.search(r"docs/results/[\w.-]+\.json", text[text.index("**End to end**"):]).group(0)
    measured = {(r["link_mbit"], r["scheme"]): r for r in json.loads((REPO / source).read_text())}
    links = {"100 Mbit/s": 100.0, "1 Gbit/s": 1000.0}
    columns = {"Horovod fp16": "hvd_fp16"}
    table = _readme_e2e_table()
    assert len(table) == 3 and all(len(cells) >= 3 for cells in table.values()), table
    for label, cells in table.items():
        link = links.get(label)  # the unshaped row: None
        for column, cell in cells.items():
            if column == "none":
                value, unit = cell.split()
                step = measured[(link, "none")]["median_step_s"] * (1000 if unit == "ms" else 1)
                assert abs(float(value) - step) <= 0.5 * 10 ** -len(value.partition(".")[2]), (label, cell, step)
            else:
                speedup = measured[(link, columns.get(column, column))]["speedup_vs_none"]
                assert cell == f"{speedup:.2f}x", (source, label, column, cell, speedup)


def test_every_document_is_linked():
    """No orphan page: every docs/**/*.md is the target of a relative link from README.md or
    another document, so a reader can reach it from the README."""
    targets = set()
    for doc in user_documents():
        for m in LINK.finditer(_without_code_blocks(doc.read_text(encoding="utf-8"))):
            file_part = m.group(1).partition("#")[0]
            if file_part and not re.match(r"^[a-z][a-z0-9+.-]*:", file_part, re.I):
                targets.add((doc.parent / file_part).resolve())
    orphans = [str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*.md")) if p.resolve() not in targets]
    assert not orphans, f"documents no page links to: {orphans}"


def _code_lines(markdown: str):
    """Each non-empty line of the ```python blocks of ``markdown``, comment dropped, stripped."""
    lines = []
    for block in re.findall(r"```python\n(.*?)```", markdown, flags=re.S):
        for line in block.splitlines():
            code = re.sub(r"\s+#.*$", "", line).strip()
            if code and not code.startswith("#"):
                lines.append(code)
    return lines


def test_elastic_code_lines_run_in_tests_as_written():
    """Every code line of docs/guide/elastic.md and of README's elastic section is a line of a
    script that a test runs: the example-shaped elastic workers, or tests/unit/test_elastic.py,
    which runs README's block itself."""
    runners = [*sorted((REPO / "tests" / "testing").glob("elastic_example_*.py")),
               REPO / "tests" / "unit" / "test_elastic.py"]
    ran = {line.strip() for path in runners for line in path.read_text(encoding="utf-8").splitlines()}
    readme = _code_lines((REPO / "README.md").read_text(encoding="utf-8").split("## Elastic training", 1)[1]
                         .split("\n## ", 1)[0])
    ran |= set(readme)  # test_readme_elastic_lines_run_as_written runs README's block as it stands
    documented = readme + _code_lines((REPO / "docs" / "guide" / "elastic.md").read_text(encoding="utf-8"))
    missing = [line for line in documented if line not in ran]
    assert documented and not missing, f"elastic code lines no test runs as written: {missing}"
