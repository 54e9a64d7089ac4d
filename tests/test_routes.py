"""The number of routes through the package does not grow unnoticed (issue 24, point 4).

``tests/route_trace.py`` runs 111 scenarios (every kernel, solve and factor, nograd, backward,
double backward, forward AD, the torch.func transforms, vmap, torch.compile, meta tensors) and
counts their routes two ways: *fine* (the distinct sets of routing-layer functions that ran) and
*coarse* (the distinct ``(entry wrapper, backward, kernel)`` triples). This test runs it in a
fresh interpreter and fails when a count exceeds what the redesigned package gave when the test
was written: a new wrapper, a new kind of backward or a new route is then a decision to make
here, by raising a bound, rather than something that slips in.

The bounds are measurements of the package after issue 24's redesign (one eager
``autograd.Function``, the compiled op, the direct kernel call; driver= selects the kernel), not
outputs copied from the code under test. The package before the redesign (commit 5d01986) gave
69 fine routes, 36 coarse triples (13 distinct (entry, backward) pairs), 6 entry wrappers
(direct kernel, _PlainTridiagonalSolve, _TridiagonalSolve, the C++ autograd op, the compiled op,
meta/fake) and 6 kinds of backward (NumPy, direct torch, differentiable, compiled, C++ fused,
C++ ATen): it fails every bound below.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tridiag_tutorial

SCRIPT = Path(__file__).with_name("route_trace.py")

# Measured on the redesigned package (torch 2.13, the C++ kernel built), all 111 scenarios.
SCENARIOS = 111
MAX_FINE_ROUTES = 47          # before the redesign: 69
MAX_COARSE_TRIPLES = 32       # before: 36
MAX_ENTRY_BACKWARD_PAIRS = 8  # before: 13
MAX_ENTRY_WRAPPERS = 4        # before: 6. Now: direct kernel, eager Function, compiled op, meta/fake
MAX_BACKWARD_KINDS = 3        # before: 6. Now: direct torch, differentiable, compiled


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
