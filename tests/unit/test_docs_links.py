"""The README and docs/ link only to what exists: every relative link names a file of
the repository, and every ``#anchor`` a heading of the page it points to (as GitHub
makes anchors from headings). Every page of docs/ opens with a title and then says what
it is for, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_anchor_follows_github():
    assert anchor("Emulated nodes with a network card per rank (`--nic-per-rank`)") == \
        "emulated-nodes-with-a-network-card-per-rank---nic-per-rank"
    assert anchor("One call: `reshard.redistribute`") == "one-call-reshardredistribute"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no such heading in {dest.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", PAGES[1:], ids=[p.name for p in PAGES[1:]])
def test_each_docs_page_opens_with_what_it_is_for(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2], page.name


def test_readme_stays_short():
    assert len(PAGES[0].read_text().splitlines()) <= 250  # a door (issue 43)


def test_architecture_picture_names_every_module():
    """docs/architecture.md's picture names each module of src/reshard (by its file name
    without .py): a module added or split must be drawn too."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    picture = text.split("```\n", 2)[1]
    src = ROOT / "src" / "reshard"
    modules = {p.stem for p in src.rglob("*.py") if p.stem != "__init__"}
    missing = sorted(m for m in modules if not re.search(rf"(?<![\w.]){m}(?!\w)", picture))
    assert not missing, f"docs/architecture.md's picture does not name: {missing}"


# --- commands ---------------------------------------------------------------------------

PROGRAM = re.compile(r"^(?:sudo )?(?:[A-Z_]+=\S+ )*(?:python3?|\.venv/bin/python) "
                     r"(?:-m (?P<module>[\w.]+)|(?P<script>benchmarks/\w+\.py))"
                     r"|^(?:sudo )?reshard (?P<sub>\w+)|^bash (?P<shell>\S+)")


def commands(page: Path) -> list[str]:
    """The command lines of a page's (non-Python) code blocks, indented ones included,
    continuation lines joined, and its inline code that is a command."""
    text = page.read_text()
    lines = [b.replace("\\\n", " ").splitlines()
             for lang, b in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang != "python"]
    found = [line.strip() for block in lines for line in block]
    found += [line[4:] for line in text.splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [c for c in found if PROGRAM.match(c)]


def flags_of(match: re.Match) -> set[str] | None:
    """The options the command's program defines (None: it has none to check)."""
    if match["sub"]:
        from reshard.tools.cli import build_parser

        sub = next(a for a in build_parser()._subparsers._group_actions
                   if hasattr(a, "choices")).choices.get(match["sub"])
        assert sub is not None, f"reshard has no command {match['sub']!r}"
        return {s for a in sub._actions for s in a.option_strings}
    if match["shell"]:
        assert (ROOT / match["shell"]).exists(), match["shell"]
        return None
    if match["module"] and not match["module"].startswith("reshard."):
        return None  # pytest, torch.distributed.run: not ours to check
    if match["module"]:
        path = ROOT / "src" / (match["module"].replace(".", "/") + ".py")
        sources = [path]
    else:
        path = ROOT / match["script"]
        sources = [path, *sorted((path.parent / (path.stem + "s")).glob("*.py"))]
    assert path.exists(), f"no {path.relative_to(ROOT)}"
    return set(re.findall(r"[\"'](--[\w-]+)[\"']", "".join(p.read_text() for p in sources)))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_commands_name_what_exists(page):
    """Each command of a page runs a script, module or `reshard` command that exists,
    with options it defines."""
    bad = []
    for command in commands(page):
        flags = flags_of(PROGRAM.match(command))
        if flags is None:
            continue
        used = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", command.split("#")[0]))
        bad += [f"{command}: {f} is not an option" for f in sorted(used - flags)]
    assert not bad, "\n".join(bad)
