"""MkDocs hook: the findings' thresholds in docs/findings.md (where the page says ``<!-- findings-thresholds -->``),
the event rules' in docs/events.md and the precision plan's in docs/plan.md,
generated at build time from the constants the rules read (each module-level constant with a ``#:`` comment in
mpdiag/analysis/findings.py and the FP8 rules' modules): the value the code uses and what the comment says it
means, so the page cannot state a threshold the code does not have."""

from __future__ import annotations

import ast
import importlib
import inspect

MARKER = "<!-- findings-thresholds -->"
MODULES = ("mpdiag.analysis.findings", "mpdiag.analysis.fp8_summaries", "mpdiag.analysis.fp8_findings")
#: docs/events.md's table, likewise, from the event rules', the replay's and the retention's constants
EVENTS_MARKER, EVENTS_MODULES = "<!-- events-thresholds -->", ("mpdiag.recording.events", "mpdiag.recording.replay",
                                                               "mpdiag.recording.retention")
#: docs/plan.md's table, likewise, from the precision plan's constants
PLAN_MARKER, PLAN_MODULES = "<!-- plan-thresholds -->", ("mpdiag.analysis.plan",)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if EVENTS_MARKER in markdown:
        markdown = markdown.replace(EVENTS_MARKER, thresholds_table(EVENTS_MODULES))
    if PLAN_MARKER in markdown:
        markdown = markdown.replace(PLAN_MARKER, thresholds_table(PLAN_MODULES))
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, thresholds_table())


def thresholds_table(modules: tuple[str, ...] = MODULES) -> str:
    rows = [f"| `{name}` | `{value!r}` | {meaning} | `{module.rsplit('.', 1)[-1]}.py` |"
            for module in modules for name, value, meaning in documented_constants(module)]
    return "| constant | value | what it is | in |\n|---|---|---|---|\n" + "\n".join(rows)


def documented_constants(module_name: str) -> list[tuple[str, object, str]]:
    """(name, value, comment) of each module-level constant (an UPPER_CASE name bound to a number) under a ``#:``
    comment block, or on the line right after such a constant (a block documenting two constants)."""
    module = importlib.import_module(module_name)
    lines = inspect.getsource(module).splitlines()
    found, previous = [], None  # previous: (comment, last line) of the constant just documented
    for node in ast.parse("\n".join(lines)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
        value = getattr(module, names[0], None) if names else None
        if not names or isinstance(value, bool) or not isinstance(value, int | float):
            previous = None
            continue
        comment, row = [], node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#:"):
            comment.insert(0, lines[row].strip().removeprefix("#:").strip())
            row -= 1
        meaning = " ".join(comment) if comment else (previous[0] if previous and previous[1] == node.lineno - 1 else None)
        previous = (meaning, node.end_lineno) if meaning else None
        if meaning:
            found.append((names[0], value, meaning.replace("|", "\\|")))
    return found
