"""Fail when a committed notebook holds an output that readers or another machine would not see.

The book renders committed outputs and nbval compares them on every run, on whatever machine CI
gets. So a notebook must not hold:

- an error output, except in a cell tagged ``raises-exception``;
- a code cell that was never executed;
- an nbval marker written as a comment (``# NBVAL_...``): the reader would see it. nbval's markers
  are cell tags (``nbval-ignore-output``, ``nbval-skip``, ``raises-exception``);
- in a cell the reader sees (not tagged ``remove-cell`` or ``remove-output``), a printed boolean
  (a line ``name: True`` or a bare ``True``): print the value or the first line of the message;
  nbval's comparison of that value is the check, and what the reader need not see is a test in
  ``tests/``;
- a ``print`` of a literal sentence (string constants only, nothing computed in it, such as
  ``print("max |x - y| < 1e-13")``): a printed line is a computed value, never a claim;
- a hidden code cell (tagged ``remove-cell`` or ``remove-input``) longer than 8 lines: Colab
  shows it in plain view. A check the reader need not see is a test in ``tests/``;
- in a markdown cell or a visible code cell, words about the project rather than the subject
  ("committed", "nbval", "CI");
- in a *checked* cell (one nbval compares: not tagged ``nbval-ignore-output`` / ``nbval-skip``),
  a printed float from 1e-9 down to 1e-11 in magnitude, written in scientific notation
  (``3.1e-10``): such digits differ between CPU models, BLAS kernels and thread counts. Smaller
  ones are round-off, and nbval's sanitizer (``notebooks/nbval-sanitize.cfg``) reads any of them
  as ``ROUNDOFF``, so the reader sees the computed value and the comparison checks that it stays
  round-off. Round a larger figure to what is stable (``f"{x:.1e}"`` of a value that does not
  sit on a rounding edge, a ratio to ``eps``, an order of magnitude). A number right after ``<``
  or ``<=`` is a bound and passes, and so does the float64 machine epsilon. A cell whose tiny
  numbers are exact on every machine (inputs, a grid of step sizes, scalar libm results) says so
  with the tag ``deterministic-output``, and why in the cell's metadata key ``deterministic``;
- an ``assert`` in a cell that reads a clock (``perf_counter``, ``timeit``, ``time.time``,
  ``torch.utils.benchmark``): timing claims come from committed benchmark results, never from a
  live measurement that a loaded machine can fail;
- a checked cell that prints a version number (``torch.__version__``);
- a cell that reads torch's own source (``inspect.getsource(torch...)``), which changes between
  torch releases.
"""
import ast
import json
import re
import sys
from pathlib import Path

TINY = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?[eE]-(\d+)\b")
BOUND = re.compile(r"(?:<|<=|\u2264)\s*$")
EPSILON = {"2.2e-16", "2.22e-16", "2.220e-16", "2.2204e-16", "1.1e-16", "1.11e-16"}
CLOCKS = re.compile(r"perf_counter|process_time|\btimeit\b|time\.time\(|torch\.utils\.benchmark|"
                    r"\bTimer\(|blocked_autorange|adaptive_autorange")
IGNORED = ("nbval-ignore-output", "nbval-skip")
HIDDEN = ("remove-cell", "remove-output")
CONCEALED = ("remove-cell", "remove-input")  # the book hides the code; Colab shows it
HIDDEN_LINES = 8
MARKER = re.compile(r"#\s*NBVAL_")
BOOLEAN = re.compile(r"(?::\s*(?:True|False)\b)|(?:^\s*(?:True|False)\s*$)", re.M)
PROJECT_TALK = re.compile(r"\bcommitted\b|\bnbval\b|\bNBVAL|\bCI\b|\btest harness\b", re.I)
TIMERS = re.compile(CLOCKS.pattern + r"|median_time|_times?\(")


def _names(node):
    """Names a node reads."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _base(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _bound_names(stmt):
    """Names a statement binds or fills: assignment targets, ``x[k] = ...``, ``x.append(...)``."""
    targets = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        if isinstance(func, ast.Attribute) and func.attr in ("append", "extend", "update"):
            targets = [func.value]
    out = set()
    for target in targets:
        for node in (target.elts if isinstance(target, ast.Tuple) else [target]):
            if _base(node):
                out.add(_base(node))
    return out


def _statements(body):
    """The statements of a cell, into loops and branches but not into function bodies."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _statements(getattr(stmt, field, []) or [])


def _calls(node):
    """Names of the functions a node calls (``f(...)``, ``obj.f(...)``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            func = n.func
            out.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", None))
    return out


def timing_asserts(cells):
    """Indices of code cells that assert on a value measured with a clock, in this or an earlier
    cell: names bound by a statement that calls a timer (a clock, or a function of the notebook
    whose body calls one), and names computed from those. A cell is flagged when an ``assert``
    reads such a name, or when a cell that asserts lets such a name steer it (an ``if`` or
    ``while`` test: "measure again until it is fast enough, else fail"). A function whose body
    reads a measured name counts as measured itself (``assert ratio(n) > 1`` with ``ratio``
    reading the timings), and a call of a function that asserts, with a measured argument, counts
    as an assert (``check_claims(timings)``)."""
    timed, timer_functions, asserting_functions, found = set(), set(), set(), []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "\n".join(line for line in "".join(cell.get("source", [])).splitlines()
                           if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):  # functions that time something are timers themselves
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = ast.Module(body=node.body, type_ignores=[])
                if TIMERS.search(ast.unparse(body)) or _calls(body) & timer_functions:
                    timer_functions.add(node.name)
                if _names(body) & timed:  # a function of measured values: its result is one too
                    timed.add(node.name)
                if any(isinstance(n, ast.Assert) for n in ast.walk(body)):
                    asserting_functions.add(node.name)
        asserts, steering = False, set()
        flagged = False
        for stmt in _statements(tree.body):
            if isinstance(stmt, ast.Assert):
                asserts = True
                flagged |= bool(_names(stmt.test) & timed)
            elif isinstance(stmt, (ast.If, ast.While)):
                steering |= _names(stmt.test)
            elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)):
                value = stmt.value if stmt.value is not None else stmt
                # a function that asserts, called on measured values
                flagged |= bool(_calls(value) & asserting_functions and _names(value) & timed)
                if (TIMERS.search(ast.unparse(value)) or _calls(value) & timer_functions
                        or _names(value) & timed):
                    timed |= _bound_names(stmt)
                elif isinstance(stmt, ast.Assign):  # a name bound again to an untimed value
                    timed -= {t.id for target in stmt.targets
                              for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                              if isinstance(t, ast.Name)}
        if flagged or (asserts and steering & timed):
            found.append(index)
    return found


def literal_prints(source: str) -> list[str]:
    """The sentences a cell prints from string constants alone: ``print("...")`` or an f-string
    with nothing in its braces."""
    code = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "print" and node.args):
            parts = []
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    parts.append(arg.value)
                elif isinstance(arg, ast.JoinedStr) and all(
                        isinstance(v, ast.Constant) for v in arg.values):
                    parts.append("".join(v.value for v in arg.values))
                else:
                    break
            else:
                if any(re.search(r"[A-Za-z]", part) for part in parts):
                    found.append(" ".join(parts))
    return found


def _text(output) -> str:
    if "text" in output:
        text = output["text"]
    else:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else str(text)


def cell_problems(index, cell):
    source = "".join(cell.get("source", []))
    tags = cell.get("metadata", {}).get("tags", [])
    hidden = any(tag in tags for tag in HIDDEN)
    if cell["cell_type"] == "markdown":
        match = PROJECT_TALK.search(source)
        if match:
            yield (f"markdown cell {index} speaks of the project ({match.group(0)!r}), not the "
                   f"subject: say what the reader sees")
        return
    if cell["cell_type"] != "code":
        return
    if cell.get("execution_count") is None:
        yield f"code cell {index} was never executed"
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error" and "raises-exception" not in tags:
            yield f"code cell {index} raised {output.get('ename')}: {output.get('evalue')}"
    for sentence in literal_prints(source):
        yield (f"code cell {index} prints a literal sentence ({sentence[:50]!r}): print the "
               f"computed value, and put a check the reader need not see in tests/")
    if any(tag in tags for tag in CONCEALED):
        lines = [line for line in source.splitlines() if line.strip()]
        if len(lines) > HIDDEN_LINES:
            yield (f"code cell {index} is hidden in the book but shown in Colab, {len(lines)} "
                   f"lines: keep it to {HIDDEN_LINES}, a check the reader need not see goes to tests/")
    if MARKER.search(source):
        yield f"code cell {index} writes an nbval marker as a comment: use the cell tag instead"
    if re.search(r"inspect\.getsource\(torch\.", source):
        yield f"code cell {index} reads torch's own source, which changes between releases"
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    if CLOCKS.search(code) and re.search(r"^\s*assert\b", code, re.M):
        yield f"code cell {index} reads a clock and asserts: no notebook may assert on a timing"
    if not hidden:
        match = PROJECT_TALK.search(source)
        if match:
            yield f"code cell {index} speaks of the project ({match.group(0)!r}) where the reader sees it"
        for output in cell.get("outputs", []):
            match = BOOLEAN.search(_text(output))
            if match:
                yield (f"code cell {index} prints a boolean ({match.group(0).strip()!r}): show the "
                       f"value or the message; a check the reader need not see goes to tests/")
                break
    if any(tag in tags for tag in IGNORED):
        return
    if "__version__" in source and re.search(r"print\(.*__version__", source):
        yield (f"code cell {index} prints a version number in a checked output: another "
               f"installation (Colab, a newer torch) prints another; tag it nbval-ignore-output")
    if "deterministic-output" in tags:
        if not str(cell.get("metadata", {}).get("deterministic", "")).strip():
            yield (f"code cell {index} is tagged deterministic-output without a reason in its "
                   f"metadata key 'deterministic'")
        return
    for output in cell.get("outputs", []):
        text = _text(output)
        for match in TINY.finditer(text):
            bound = BOUND.search(text[max(0, match.start() - 4):match.start()])
            if 9 <= int(match.group(1)) <= 11 and not bound and match.group(0) not in EPSILON:
                yield (f"code cell {index} prints {match.group(0)}, round-off that another CPU "
                       f"prints differently: round it to what is stable")
                break


def problems(folder):
    for path in sorted(Path(folder).glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for index, cell in enumerate(nb["cells"]):
            for problem in cell_problems(index, cell):
                yield f"{path}: {problem}"
        for index in timing_asserts(nb["cells"]):
            yield f"{path}: code cell {index} asserts on a timing measured in the notebook"


if __name__ == "__main__":
    found = list(problems(sys.argv[1] if len(sys.argv) > 1 else "notebooks"))
    print("\n".join(found) or "notebooks: no unexpected errors, round-off or timing assertions")
    sys.exit(1 if found else 0)
