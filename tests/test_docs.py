"""The documentation: README.md stays a short entry point, the reference in docs/ builds as a site with
`mkdocs build --strict` (every link and anchor checked, mkdocs.yml's `validation`), every page is in the nav, and
what the docs cite exists (the README's links, the conformance table's tests, the docs pages code points to)."""

import os
import re
import subprocess
import sys

import yaml
from conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages(nav) -> list[str]:
    """Every page file named in mkdocs.yml's nav, sections included."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def section(path, heading: str) -> str:
    """The text of a markdown file's ``#``/``##`` section ``heading``, up to the next heading of level 1 or 2."""
    text = "\n" + path.read_text()
    match = re.search(rf"\n#{{1,2}} {re.escape(heading)}\n", text)
    assert match, f"{path.name} has no section {heading!r}"
    rest = text[match.end():]
    end = re.search(r"\n#{1,2} ", rest)
    return rest[:end.start()] if end else rest


def test_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict` with the Material theme: a broken link, a missing anchor or a page left out of the
    nav is a warning, and strict makes any warning fail the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert config()["theme"]["name"] == "material"
    for page in nav_pages(config()["nav"]):
        built = tmp_path / "site" / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page


def test_the_cli_reference_is_generated_from_the_parser(tmp_path):
    """docs/cli.md's reference of every command and flag is built from mpdiag's own parser (the options table's
    flags included), so it names every flag `--help` names, with the same help."""
    import argparse

    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from cli_reference import MARKER, cli_reference
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    from mpdiag.cli import build_parser
    from mpdiag.options import OPTIONS, flag

    assert MARKER in (DOCS / "cli.md").read_text()
    text = cli_reference(build_parser())
    for name, spec in OPTIONS.items():
        if spec.no_flag is None:
            assert f"`{flag(name)}`" in text, name
            assert " ".join(spec.help.split()) in text, name
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert all(f"### `python -m mpdiag {name}`" in text for name in commands)
    assert "(default None)" not in text and "(default False)" not in text


def test_the_findings_thresholds_are_the_codes(tmp_path):
    """docs/findings.md's thresholds table is generated from the constants the rules read; the rule table written
    by hand states the same numbers."""
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from findings_thresholds import MARKER, thresholds_table
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    from mpdiag.analysis import findings

    page = (DOCS / "findings.md").read_text()
    table = thresholds_table()
    assert MARKER in page
    for name in ("LOW_RANGE_SHARE", "LOW_RANGE_TARGET", "SKIP_SHARE", "CONSECUTIVE_SKIPS", "FP16_SPAN_BINS",
                 "SWAMPED_SHARE", "GRADIENT_REL_ERROR", "MAX_RECOMMENDED_LOG2", "LOST_SHARE", "MAX_MARGIN"):
        assert f"| `{name}` |" in table, name
    rules = section(DOCS / "findings.md", "Findings: what is wrong, where, and what to change")
    assert f"more than {findings.LOW_RANGE_SHARE:.0%}" in rules.replace(" %", "%")
    assert f"below {findings.LOW_RANGE_TARGET:.1%}" in rules.replace(" %", "%")
    assert f"more than {findings.SKIP_SHARE:.0%} of steps skipped, or {findings.CONSECUTIVE_SKIPS} in a row" in \
        rules.replace(" %", "%")
    assert f"65504: {findings.FP16_SPAN_BINS} bins" in rules
    assert f"more than {findings.SWAMPED_SHARE:.0%} of the updates" in rules.replace(" %", "%")
    assert f"above {findings.GRADIENT_REL_ERROR:g} against the FP32 shadow" in rules


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_every_docs_page_is_in_the_nav():
    pages = nav_pages(config()["nav"])
    on_disk = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk
    assert len(pages) == len(set(pages))


def test_readme_links_resolve():
    """README.md is not part of the site, so mkdocs does not check it: its relative links must name files here."""
    targets = [target for target in LINK.findall((ROOT / "README.md").read_text()) if "://" not in target]
    assert any(target.startswith("docs/") for target in targets)
    for target in targets:
        assert (ROOT / target.split("#", 1)[0]).exists(), target
    linked = {target.split("#", 1)[0] for target in targets}
    assert {f"docs/{page}" for page in nav_pages(config()["nav"])} <= linked  # every docs page is reachable


def test_docs_index_quick_start_is_the_readmes():
    assert section(DOCS / "index.md", "Quick start") == section(ROOT / "README.md", "Quick start")


def test_conformance_table_cites_tests_that_exist():
    """docs/watch.md's conformance table: every test it names is a test function (a parametrisation id, in
    brackets, one of that test's ids) in the file it names, tests/e2e/test_watch_frameworks.py where it names none."""
    table = section(DOCS / "watch.md", "Conformance: each framework against its own numbers")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| framework")]
    assert len(rows) >= 10
    cited = 0
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[1]
        test_file, function = "tests/e2e/test_watch_frameworks.py", None
        for ref in re.findall(r"`([^`]+)`", cell):
            path, _, name = ref.rpartition("::") if "::" in ref else ("", "", ref)
            if path or name.startswith("tests/"):
                test_file = path or name
                assert (ROOT / test_file).is_file(), ref
                if not path:
                    continue
            source = (ROOT / test_file).read_text()
            named, _, param = name.partition("[")
            function = named or function  # `[id]` alone: another id of the test named before it
            assert function and re.search(rf"\ndef {re.escape(function)}\(", source), f"{ref} in {test_file}"
            assert not param or f'"{param.removesuffix("]")}"' in source, f"{ref}: no such id in {test_file}"
            cited += 1
    assert cited >= 10


def test_docs_pages_that_code_points_to_exist():
    """Comments, docstrings and messages that point into the docs name a page that exists."""
    shipped = [*(ROOT / "mpdiag").rglob("*.py"), ROOT / "app.py", *(ROOT / "pages").glob("*.py")]
    pointers = {(path.relative_to(ROOT), page) for path in shipped for page in re.findall(r"docs/[\w-]+\.md",
                                                                                           path.read_text())}
    assert pointers, "code points into docs/"
    missing = [f"{path}: {page}" for path, page in sorted(pointers) if not (ROOT / page).is_file()]
    assert not missing


def test_the_events_thresholds_are_the_codes():
    """docs/events.md's thresholds table is generated from the constants the event rules and the retention of
    anomalous steps read."""
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from findings_thresholds import EVENTS_MARKER, EVENTS_MODULES, thresholds_table
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    assert EVENTS_MARKER in (DOCS / "events.md").read_text()
    table = thresholds_table(EVENTS_MODULES)
    for name in ("SKIP_STREAK", "SCALE_FLOOR", "SPIKE_WINDOW", "SPIKE_SIGMAS", "SPIKE_MIN_VALUES", "SPIKE_MIN_RISE",
                 "MAX_PER_KIND", "SHARE_JUMP", "MIN_JUMP_VALUES", "AROUND", "DENSE_START_STEPS", "THIN_EVERY"):
        assert f"| `{name}` |" in table, name
