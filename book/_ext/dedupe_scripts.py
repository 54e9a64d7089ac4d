"""Drop duplicate inline <script> tags from every HTML page.

Sphinx 7.4 adds an inline script (one registered with a body and no file name) twice when an
extension registers it after the builder has started, as sphinx-thebe and sphinx-togglebutton
do: once as filename ``None`` and once as ``''``. A duplicated ``const THEBE_JS_URL = ...`` is a
JavaScript SyntaxError on every page ("Identifier 'THEBE_JS_URL' has already been declared").
This extension keeps the first of each set of identical scripts. tests/browser_check.py fails on
any page error, so it notices if this stops working.
"""

from __future__ import annotations


def _key(script):
    attributes = tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items()))
    return (getattr(script, "filename", script) or "", getattr(script, "priority", 0), attributes)


def dedupe_script_files(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    # Late priority: run after the theme and the other extensions have added their scripts.
    app.connect("html-page-context", dedupe_script_files, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
