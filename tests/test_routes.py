"""The number of routes through the package does not grow unnoticed, and every optional route
pays.

``tests/route_trace.py`` runs 143 scenarios (every kernel named with ``driver=`` and the automatic
choice ``driver=None`` on the CPU; solve and factor; nograd, backward, double backward, forward
AD, the torch.func transforms, vmap, torch.compile, meta tensors) and counts their routes two
ways: *fine* (the distinct sets of routing-layer functions that ran) and *coarse* (the distinct
``(entry wrapper, backward, kernel)`` triples). This test runs it in a fresh interpreter and
fails when a count exceeds what the package gave when the test was written: a new wrapper, a new
kind of backward or a new route is then a decision to make here, by raising a bound, rather than
something that slips in.

The bounds are measurements of the package after the layout of ``tridiag_tutorial.api``,
``functions`` and ``registration`` (torch 2.13, the C++ kernel built), not outputs copied from the
code under test. Its entries: the direct kernel call, the C++ fast path called directly and
through its Function (``_CppSolve``), the eager Function, the compiled op, meta/fake; its kinds
of backward: direct torch, differentiable, compiled, C++ fused. The package before issue 24's
redesign (commit 5d01986) gave 69 fine routes over 111 scenarios, 6 entry wrappers and 6 kinds
of backward; the redesign's bounds (47, 4 and 3) were measured without the ``driver=None`` CPU
scenarios, which the trace did not run then.

Each optional route has a switch (:mod:`tridiag_tutorial._routes`), and the committed route rows
(``python -m tridiag_tutorial.bench.benchmarks --routes-only``) must show that it pays, at least
1.25 times over the route without it, in one of the cases they measure.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tridiag_tutorial

SCRIPT = Path(__file__).with_name("route_trace.py")

# Measured on the package (torch 2.13, the C++ kernel built), all 143 scenarios.
SCENARIOS = 143
MAX_FINE_ROUTES = 59
MAX_COARSE_TRIPLES = 35
MAX_ENTRY_BACKWARD_PAIRS = 11
MAX_ENTRY_WRAPPERS = 6
MAX_BACKWARD_KINDS = 4
PAYS = 1.25
RESULTS = Path(__file__).parent.parent / "notebooks" / "data" / "benchmark_results.json"
# switch -> (the route row without it, the row it is compared with: None for the op as installed)
SWITCH_ROWS = {
    "cpp_fast_path": ("without the C++ fast path", None),
    "fused_backward": ("without the fused C++ backward", None),
    "direct_kernel": ("without direct kernel calls", None),
    "function_apply": ("Function.apply instead of _compat.function_apply",
                       "without the C++ fast path"),
}


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    """The JSON summary of ``route_trace.py`` run on the package this test imports (a fresh
    interpreter: it installs ``sys.settrace`` and resets Dynamo, which would disturb pytest)."""
    out = tmp_path_factory.mktemp("routes") / "routes.json"
    package_root = str(Path(tridiag_tutorial.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--coarse", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_routes_do_not_grow(routes):
    s, c = routes, routes["coarse"]
    assert s["api"] == "driver", "route_trace.py found the API of before the redesign"
    if not s["unavailable"]:  # without the C++ kernel its scenarios are left out: bounds still hold
        assert s["scenarios"] == SCENARIOS, "the scenarios changed: measure the bounds again"
    raised = [f"{r['name']}: {r['error']}" for r in s["results"] if r["error"]]
    assert not raised, raised
    table = "\n".join(f"{t['entry']} | {t['backward']} | {t['kernel']}" for t in c["table"])
    assert s["routes"] <= MAX_FINE_ROUTES, f"{s['routes']} fine routes (of function sets)"
    assert c["triples"] <= MAX_COARSE_TRIPLES, f"{c['triples']} coarse routes:\n{table}"
    assert c["paths"] <= MAX_ENTRY_BACKWARD_PAIRS, f"{c['paths']} (entry, backward) pairs:\n{table}"
    assert len(c["entries"]) <= MAX_ENTRY_WRAPPERS, c["entries"]
    assert len(c["backward_kinds"]) <= MAX_BACKWARD_KINDS, c["backward_kinds"]


def test_every_optional_route_pays_in_the_committed_rows():
    """Each switch of _routes has committed rows, measured with that route off, of which one
    shows the route pays PAYS times or more (the function_apply route: over the row without the
    C++ fast path, which it is measured on top of)."""
    from tridiag_tutorial import _routes
    from tridiag_tutorial.bench import benchmarks

    rows = json.loads(RESULTS.read_text())["routes"]
    assert set(SWITCH_ROWS) == set(_routes.ROUTES)
    best = {}
    for switch, (without, baseline) in SWITCH_ROWS.items():
        assert without in benchmarks.ROUTES, without
        by_case = {(r["mode"], r["n"], r["batch"], r["threads"]): r["ratio"] for r in rows
                   if r["route"] == without}
        if baseline is not None:
            base = {(r["mode"], r["n"], r["batch"], r["threads"]): r["ratio"] for r in rows
                    if r["route"] == baseline}
            by_case = {case: ratio / base[case] for case, ratio in by_case.items()}
        assert by_case, f"no committed rows for {without!r}"
        best[switch] = max(by_case.values())
    assert all(ratio >= PAYS for ratio in best.values()), best
