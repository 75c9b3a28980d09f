"""docs/results/ holds only results a reader is pointed at, and every pointer finds its file.

A file in docs/results/ is kept only while a document that uses it cites it: README.md or a
markdown file under docs/, by a link or by its path in the text (``docs/results/e2e.json``,
``../results/e2e.png``, ``micro.{json,png}``; inside docs/results/ also by its bare name).
Citations count along chains: a results document counts as a citer only while it is cited
itself, so a file cited only by an uncited results file is uncited too.  The index
(docs/results/README.md) lists the cited files with their commands and cites none: a row there
does not keep a file that no document uses.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
INDEX = RESULTS / "README.md"

#: a path-like token: words, dots, slashes, a glob star and a {a,b} group
TOKEN = re.compile(r"[\w.*/-]*\{[\w.,-]+\}[\w.-]*|[\w.*/-]+")
#: a token that names a file (an extension after the last dot)
FILE_LIKE = re.compile(r"\.[A-Za-z]\w*$")


def expand_braces(token: str):
    """``micro.{json,png}`` -> ``micro.json``, ``micro.png`` (one group)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [token[:m.start()] + alt + token[m.end():] for alt in m.group(1).split(",")]


def _resolve(doc: Path, name: str):
    """The docs/results path ``name`` names in ``doc``, or None when it names none; a second
    value says whether the name must exist (an explicit path) or counts only when it does
    (a bare name inside docs/results/)."""
    name = name.rstrip(".,;:")
    if "docs/results/" in name:
        return RESULTS / name.split("docs/results/", 1)[1], True
    if "/" in name:
        path = (doc.parent / name).resolve()
        if RESULTS not in path.parents:
            return None, False
        # inside docs/results/ a slashed name is more often a path from the repository's root
        return path, doc.parent != RESULTS
    if doc.parent == RESULTS:
        return RESULTS / name, False
    return None, False


def citations(doc: Path):
    """(files of docs/results/ that ``doc`` cites, explicit results paths in it that do not exist)."""
    cited, missing = set(), set()
    for token in TOKEN.findall(doc.read_text(encoding="utf-8")):
        for name in expand_braces(token):
            if not FILE_LIKE.search(name.rstrip(".,;:")):
                continue
            path, explicit = _resolve(doc, name)
            if path is None:
                continue
            if "*" in path.name:
                cited.update(p for p in path.parent.glob(path.name) if p.is_file())
            elif path.is_file():
                cited.add(path)
            elif explicit:
                missing.add(name)
    cited.discard(doc)  # a file does not cite itself
    return cited, missing


def roots():
    """The documents a reader starts from: README.md and docs/**/*.md outside docs/results/."""
    return [REPO / "README.md"] + [p for p in sorted((REPO / "docs").rglob("*.md")) if RESULTS not in p.parents]


def cited_results():
    """Every file of docs/results/ reachable from :func:`roots` through results documents
    (the index cites nothing), and the explicit results paths that name no file, by document."""
    reached, queue, missing = set(), list(roots()), {}
    while queue:
        doc = queue.pop()
        cited, gone = citations(doc)
        if gone:
            missing[str(doc.relative_to(REPO))] = sorted(gone)
        for path in cited - reached:
            reached.add(path)
            if path.suffix == ".md" and path != INDEX:
                queue.append(path)
    return reached, missing


def test_every_results_file_is_cited_by_a_document_that_uses_it():
    reached, _ = cited_results()
    files = {p for p in RESULTS.rglob("*") if p.is_file() and p != INDEX}
    uncited = sorted(str(p.relative_to(REPO)) for p in files - reached)
    assert not uncited, (f"files in docs/results/ that no document (README.md, docs/**/*.md, the index "
                         f"docs/results/README.md not counting) cites: {uncited}; cite each where it is "
                         f"discussed, with its command, or delete it")


def test_the_index_is_cited():
    assert INDEX in cited_results()[0]


def test_every_cited_results_path_exists():
    _, missing = cited_results()
    index_cited, index_missing = citations(INDEX)
    if index_missing:
        missing[str(INDEX.relative_to(REPO))] = sorted(index_missing)
    assert not missing, f"results paths named in documents that do not exist: {missing}"


def test_citations_are_read_as_documents_write_them(tmp_path):
    # the forms the documents use, read from a document inside docs/results/ and from one outside it
    inside = RESULTS / "README.md"
    assert _resolve(inside, "e2e.json") == (RESULTS / "e2e.json", False)
    assert _resolve(inside, "docs/results/e2e.json") == (RESULTS / "e2e.json", True)
    outside = REPO / "docs" / "design" / "cost_model.md"
    assert _resolve(outside, "../results/e2e.json") == (RESULTS / "e2e.json", True)
    assert _resolve(outside, "e2e.json") == (None, False)  # a bare name outside docs/results/ is not a path
    assert _resolve(outside, "hvd_compress/tools/bench/e2e.py") == (None, False)
    assert expand_braces("docs/results/micro.{json,png}") == ["docs/results/micro.json", "docs/results/micro.png"]
    doc = tmp_path / "doc.md"
    doc.write_text("see `docs/results/no_such_file.json` and [the plot](docs/results/e2e.png)\n")
    cited, missing = citations(doc)
    assert RESULTS / "e2e.png" in cited and missing == {"docs/results/no_such_file.json"}
