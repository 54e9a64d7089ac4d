"""A seeded fuzz of every entry point (issue 23): pivots, shapes, dtypes, devices and strides.

Every case either returns the right answer (against :func:`tridiag_tutorial.reference.dense_solve`) or
raises ``ValueError`` / ``TypeError`` / ``RuntimeError`` / ``torch.linalg.LinAlgError`` whose
message names the function or op. Each ``driver`` (issue 24) has its own run: the solves run on
it, the factorizations and solves from factors on the factor driver beside it (LAPACK beside the
C++ kernel, the sequential kernel beside the partitioned one), and the ``driver`` argument itself
is fuzzed (unknown names and types, kernels that do not factor, CPU-only kernels on the meta
device). The cases run in a subprocess, one per driver, because on the
code before issue 23 some of them (tampered pivots reaching LAPACK's ``?gttrs``) crashed the
process with SIGSEGV or heap corruption: a crash fails the test instead of killing pytest. The
subprocess prints each case before running it, so a crash names the case.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KERNELS, require_cpp

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, sys
import torch
import functools
from tridiag_tutorial import (
    kernels,
    to_dense,
    tridiagonal_lu_factor,
    tridiagonal_lu_solve,
    tridiagonal_solve,
)
from tridiag_tutorial.reference import dense_solve

# The solve driver under test, and the factor driver beside it (the C++ and partitioned kernels
# do not factor: LAPACK's factors beside the C++ kernel, the sequential kernel's beside the
# partitioned one).
DRIVER = sys.argv[1]
FACTOR = {"lapack": "lapack", "cpp": "lapack", "sequential": "sequential",
          "partitioned": "sequential"}[DRIVER]
g = torch.Generator().manual_seed(2023 + kernels.DRIVERS.index(DRIVER))
solve = functools.partial(tridiagonal_solve, driver=DRIVER)
lu_factor = functools.partial(tridiagonal_lu_factor, driver=FACTOR)
lu_solve = functools.partial(tridiagonal_lu_solve, driver=FACTOR)
NAMES = ("tridiagonal_solve", "tridiagonal_lu_factor", "tridiagonal_lu_solve", "tridiag_tutorial::")
ALLOWED = (ValueError, TypeError, RuntimeError, torch.linalg.LinAlgError)
ops = torch.ops.tridiag_tutorial
results = []


def system(n, batch=(), k=2, dtype=torch.float64):
    def randn(*shape):
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if dtype.is_complex:
            t = torch.complex(t, torch.randn(*shape, generator=g, dtype=torch.float64))
        return t.to(dtype)
    lower, upper = randn(*batch, n - 1), randn(*batch, n - 1)
    diag = randn(*batch, n) + 4  # well conditioned: the answer is checked to a tolerance
    rhs = randn(*batch, n) if k is None else randn(*batch, n, k)
    return lower, diag, upper, rhs


def reference(lower, diag, upper, rhs, trans="N"):
    a = to_dense(lower, diag, upper)
    a = {"N": a, "T": a.mT, "C": a.mH}[trans]
    vector = rhs.ndim == diag.ndim
    x = torch.linalg.solve(a, rhs.unsqueeze(-1) if vector else rhs)
    return x.squeeze(-1) if vector else x


def run(case, valid, fn, expected=None):
    """valid: must return ``expected()``; otherwise must raise an allowed, named error."""
    print("START", case, flush=True)
    try:
        x = fn()
    except ALLOWED as e:
        msg = str(e)
        if valid and not isinstance(e, torch.linalg.LinAlgError):
            results.append((case, f"valid input raised {type(e).__name__}: {msg[:200]}"))
        elif not any(name in msg for name in NAMES):
            results.append((case, f"error does not name the function: {type(e).__name__}: {msg[:200]}"))
        else:
            results.append((case, "ok"))
        return
    except Exception as e:  # noqa: BLE001
        results.append((case, f"unexpected {type(e).__name__}: {str(e)[:200]}"))
        return
    if not valid:
        results.append((case, f"invalid input returned {type(x).__name__} "
                              f"{getattr(x, 'shape', '')} {getattr(x, 'dtype', '')} "
                              f"{getattr(x, 'device', '')}"))
        return
    ref = expected()
    tol = 1e-3 if ref.dtype in (torch.float32, torch.complex64) else 1e-9
    if (x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device
            or not torch.allclose(x, ref, rtol=tol, atol=tol)):
        results.append((case, f"wrong answer: {tuple(x.shape)} {x.dtype} {x.device}"))
    else:
        results.append((case, "ok"))


def strided_like(t, how):
    """The same values as ``t`` with other strides."""
    if how == "sliced":  # every other element of a larger tensor
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == "transposed" and t.ndim >= 2:
        return t.mT.contiguous().mT
    return t


def bad_pivot_values(n, i, p):
    """Values that ?gttrf cannot produce at 0-based position i (p: the real pivot there)."""
    values = {"zero": 0, "negative": -1 - int(torch.randint(0, 5, (1,), generator=g)),
              "huge": 10**6, "int32_max": 2**31 - 1, "int32_min": -2**31,
              "i": i, "i+3": i + 3,
              "random": int(torch.randint(n + 2, 10 * n + 20, (1,), generator=g))}
    if i == n - 1:
        values["wrong_last"] = n - 1 if n > 1 else 2
        values["last+1"] = n + 1
    return {k: v for k, v in values.items() if not (v == i + 1 or (v == i + 2 and i < n - 1))}


# 1. valid inputs: sizes, batches (empty too), k (0 too), dtypes, strides, every entry point
for n in (1, 2, 3, 6):
    for batch in ((), (3,), (0,), (2, 1)):
        for k in (None, 0, 2):
            for dtype in (torch.float32, torch.float64, torch.complex128):
                args = system(n, batch, k, dtype)
                name = f"n={n} batch={batch} k={k} {dtype}"
                run(f"solve {name}", True, lambda: solve(*args),
                    lambda: dense_solve(*args))
                if DRIVER == "cpp":  # driver=None's fast path, and the C++ op itself
                    run(f"auto {name}", True, lambda: tridiagonal_solve(*args),
                        lambda: dense_solve(*args))
                    run(f"op cpp_solve {name}", True, lambda: ops.cpp_solve(*args)[0],
                        lambda: dense_solve(*args))
                if batch == (0,):
                    continue
                f = lu_factor(*args[:3])
                for trans in ("N", "T", "C"):
                    run(f"lu_solve {name} {trans}", True,
                        lambda: lu_solve(f, args[3], trans),
                        lambda: reference(*args, trans))
                if k is not None and k > 0:
                    for how in ("sliced", "transposed"):
                        s = [strided_like(t, how) for t in args]
                        fs = f._replace(lu=strided_like(f.lu, how),
                                        pivots=strided_like(f.pivots, how))
                        run(f"solve {how} {name}", True, lambda: solve(*s),
                            lambda: dense_solve(*args))
                        if DRIVER == "cpp":
                            run(f"auto {how} {name}", True, lambda: tridiagonal_solve(*s),
                                lambda: dense_solve(*args))
                        run(f"lu_solve {how} {name}", True,
                            lambda: lu_solve(fs, s[3], "T"),
                            lambda: reference(*args, "T"))
                    run(f"op solve {name}", True,
                        lambda: ops.solve(*args, None, None, "N", DRIVER),
                        lambda: dense_solve(*args))
                    run(f"op solve_kernel factors {name}", True,
                        lambda: ops.solve_kernel(*args, f.lu, f.pivots, "C", FACTOR),
                        lambda: reference(*args, "C"))
                    run(f"op lu_factor {name}", True,
                        lambda: ops.solve_kernel(*args, *ops.lu_factor(*args[:3], FACTOR),
                                                 "N", FACTOR),
                        lambda: dense_solve(*args))
# expanded (stride-0) batch dimensions
lower, diag, upper, rhs = system(5, (), 2)
ex = (lower.expand(3, 4), diag.expand(3, 5), upper.expand(3, 4), rhs.expand(3, 5, 2))
run("solve expanded", True, lambda: solve(*ex), lambda: dense_solve(*ex))
fe = lu_factor(*ex[:3])
run("lu_solve expanded", True, lambda: lu_solve(fe, ex[3]), lambda: dense_solve(*ex))

# 2. tampered pivots: every position, every kind of bad value, through every entry point
for n in (1, 2, 3, 6):
    for batch in ((), (4,)):
        args = system(n, batch, 2)
        f = lu_factor(*args[:3])
        for i in range(n):
            element = (int(torch.randint(0, 4, (1,), generator=g)),) if batch else ()
            real = int(f.pivots[(*element, i)])
            for kind, value in bad_pivot_values(n, i, real).items():
                p = f.pivots.clone()
                p[(*element, i)] = value
                t = f._replace(pivots=p)
                case = f"pivots n={n} batch={batch} [{i}]={value} ({kind})"
                trans = "NTC"[i % 3]
                run("lu_solve " + case, False, lambda: lu_solve(t, args[3], trans))
                run("op solve " + case, False,
                    lambda: ops.solve(*args, f.lu, p, trans, FACTOR))
                run("op solve_kernel " + case, False,
                    lambda: ops.solve_kernel(*args, f.lu, p, trans, FACTOR))
                if i == 0 and batch:  # a tampered value in an expanded (broadcast) rhs batch
                    run("lu_solve broadcast " + case, False,
                        lambda: lu_solve(t, args[3].expand(2, *args[3].shape)))

# 3. metadata: dtypes, shapes, devices (meta), missing factors, trans
lower, diag, upper, rhs = system(5, (2,), 1)
f = lu_factor(lower, diag, upper)
bands = (lower, diag, upper)
meta = lambda t: t.to("meta")  # noqa: E731
bad_factors = {"lu float32": dict(lu=f.lu.float()), "lu complex": dict(lu=f.lu.cdouble()),
               "lu int": dict(lu=f.lu.int()), "pivots int64": dict(pivots=f.pivots.long()),
               "pivots float": dict(pivots=f.pivots.double()),
               "lu meta": dict(lu=meta(f.lu)), "pivots meta": dict(pivots=meta(f.pivots)),
               "lu short": dict(lu=f.lu[..., :3, :]), "pivots short": dict(pivots=f.pivots[:, :4]),
               "lu unbatched": dict(lu=f.lu[0]), "pivots unbatched": dict(pivots=f.pivots[0]),
               "lu None": dict(lu=None), "pivots None": dict(pivots=None),
               "diag meta": dict(diag=meta(diag)), "lower short": dict(lower=lower[..., :3])}
for what, change in bad_factors.items():
    t = f._replace(**change)
    run(f"lu_solve {what}", False, lambda: lu_solve(t, rhs))
    if "lu" in change or "pivots" in change:
        run(f"op solve {what}", False,
            lambda: ops.solve(*bands, rhs, t.lu, t.pivots, "N", FACTOR))
        run(f"op solve_kernel {what}", False,
            lambda: ops.solve_kernel(*bands, rhs, t.lu, t.pivots, "T", FACTOR))
for which in range(4):
    for what, bad in (("meta", meta), ("float32", lambda t: t.float()),
                      ("int64", lambda t: t.long()), ("half", lambda t: t.half())):
        a = [lower, diag, upper, rhs]
        a[which] = bad(a[which])
        run(f"solve {what} arg {which}", False, lambda: solve(*a))
        run(f"op solve {what} arg {which}", False,
            lambda: ops.solve(*a, None, None, "N", DRIVER))
        run(f"op solve_kernel {what} arg {which}", False,
            lambda: ops.solve_kernel(*a, f.lu, f.pivots, "N", FACTOR))
        if which < 3:
            run(f"lu_factor {what} arg {which}", False, lambda: lu_factor(*a[:3]))
            run(f"op lu_factor {what} arg {which}", False,
                lambda: ops.lu_factor(*a[:3], FACTOR))
for what, r in (("7 rows", torch.ones(2, 7, 1, dtype=torch.float64)),
                ("vector", rhs[..., 0]), ("unbatched", rhs[0]),
                ("scalar", torch.tensor(1.0, dtype=torch.float64))):
    run(f"op solve rhs {what}", False, lambda: ops.solve(*bands, r, None, None, "N", DRIVER))
    run(f"op solve_kernel rhs {what}", False,
        lambda: ops.solve_kernel(*bands, r, f.lu, f.pivots, "N", FACTOR))
run("op solve trans T without factors", False,
    lambda: ops.solve(*bands, rhs, None, None, "T", DRIVER))
run("op solve_kernel trans X", False,
    lambda: ops.solve_kernel(*bands, rhs, f.lu, f.pivots, "X", FACTOR))
run("lu_solve trans X", False, lambda: lu_solve(f, rhs, "X"))
run("op lu_factor batch mismatch", False, lambda: ops.lu_factor(lower[0], diag, upper, FACTOR))
run("lu_factor n=0", False,
    lambda: lu_factor(torch.ones(0), torch.ones(0), torch.ones(0)))

# 4. the driver argument: unknown names, other types, kernels that do not factor, CPU-only
# kernels for tensors that are not on the CPU
lower, diag, upper, rhs = system(5, (2,), 2)
f = lu_factor(lower, diag, upper)
bands = (lower, diag, upper)
BAD = ("bogus", "LAPACK", "", "torch", "cuda", " lapack", 1, True, 1.5, ("lapack",))
# Only the public functions see bytes: the ops' ``str`` arguments take them as their text (torch's
# argument parser decodes them), so b"lapack" reaches an op as "lapack".
PUBLIC_ONLY = (b"lapack",)
NO_FACTORS = tuple(d for d in kernels.DRIVERS if d not in kernels.FACTOR_DRIVERS)
for bad in BAD + PUBLIC_ONLY:
    run(f"solve driver={bad!r}", False, lambda: tridiagonal_solve(*bands, rhs, driver=bad))
    if bad not in PUBLIC_ONLY:
        run(f"op solve driver={bad!r}", False,
            lambda: ops.solve(*bands, rhs, None, None, "N", bad))
        run(f"op solve_kernel driver={bad!r}", False,
            lambda: ops.solve_kernel(*bands, rhs, None, None, "N", bad))
for bad in BAD + PUBLIC_ONLY + NO_FACTORS:
    run(f"lu_factor driver={bad!r}", False, lambda: tridiagonal_lu_factor(*bands, driver=bad))
    run(f"lu_solve driver={bad!r}", False, lambda: tridiagonal_lu_solve(f, rhs, driver=bad))
    if bad in PUBLIC_ONLY:
        continue
    run(f"op lu_factor driver={bad!r}", False, lambda: ops.lu_factor(*bands, bad))
    run(f"op solve factors driver={bad!r}", False,
        lambda: ops.solve(*bands, rhs, f.lu, f.pivots, "N", bad))
    run(f"op solve_kernel factors driver={bad!r}", False,
        lambda: ops.solve_kernel(*bands, rhs, f.lu, f.pivots, "T", bad))
run("op solve driver=None", False, lambda: ops.solve(*bands, rhs, None, None, "N", None))
fm = f._replace(**{k: meta(v) for k, v in f._asdict().items()})
for cpu_only in ("lapack", "cpp"):
    run(f"solve meta driver={cpu_only}", False,
        lambda: tridiagonal_solve(*(meta(t) for t in (*bands, rhs)), driver=cpu_only))
    if cpu_only in kernels.FACTOR_DRIVERS:
        run(f"lu_factor meta driver={cpu_only}", False,
            lambda: tridiagonal_lu_factor(*(meta(t) for t in bands), driver=cpu_only))
        run(f"lu_solve meta driver={cpu_only}", False,
            lambda: tridiagonal_lu_solve(fm, meta(rhs), driver=cpu_only))
# every driver of the same system, through the public function: the right answer
for other in kernels.DRIVERS:
    if other == "cpp" and not kernels.cpp_available():
        continue
    run(f"solve driver={other}", True, lambda: tridiagonal_solve(*bands, rhs, driver=other),
        lambda: dense_solve(*bands, rhs))

# 5. driver=None, whose fast path on the CPU hands unvalidated tensors to the C++ op, and the C++
# kernel's own op cpp_solve (their valid inputs run in section 1): every kind of bad metadata
if DRIVER == "cpp":
    lower, diag, upper, rhs = system(5, (2,), 2)
    good = [lower, diag, upper, rhs]
    variants = {"meta": meta, "float32": lambda t: t.float(), "int64": lambda t: t.long(),
                "half": lambda t: t.half(), "short": lambda t: t[..., :-1],
                "unbatched": lambda t: t[0], "extra dim": lambda t: t[None],
                "scalar": lambda t: t.reshape(-1)[0], "sparse": lambda t: t.to_sparse(),
                "undefined": lambda t: None}
    for which in range(4):
        for what, bad in variants.items():
            a = list(good)
            a[which] = bad(a[which])
            try:  # valid for driver=None where the general path takes it (bands broadcast)
                named = tridiagonal_solve(*a, driver="lapack")
            except ALLOWED:
                named = None
            run(f"auto {what} arg {which}", named is not None, lambda: tridiagonal_solve(*a),
                lambda: named)
            k_one = what == "short" and which == 3  # rhs (2, 5, 1): one column, valid
            run(f"op cpp_solve {what} arg {which}", k_one, lambda: ops.cpp_solve(*a)[0],
                lambda: dense_solve(*a))
    # the C++ backward op (tridiagonal_solve's backward on this kernel): x and grad_x of rhs's
    # shape; each bad argument in turn, and x and grad_x bad together
    x = dense_solve(lower, diag, upper, rhs)
    good = [lower, diag, upper, x, rhs]
    for which in (0, 1, 2, 3, 4, (3, 4)):
        for what, bad in variants.items():
            a = list(good)
            for i in (which if isinstance(which, tuple) else (which,)):
                a[i] = bad(a[i])
            valid = which == (3, 4) and what == "short"  # x, grad_x (2, 5, 1): valid
            run(f"op cpp_solve_backward {what} arg {which}", valid,
                lambda: ops.cpp_solve_backward(*a)[3],
                lambda: dense_solve(upper, diag, lower, a[4]))

print("RESULTS", json.dumps(results), flush=True)
'''


@pytest.mark.parametrize("driver", KERNELS)
def test_fuzz_every_entry_point(driver):
    if driver == "cpp":
        require_cpp()
    proc = subprocess.run([sys.executable, "-c", WORKER, driver], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("RESULTS "):
        started = [line for line in lines if line.startswith("START ")]
        last = started[-1][6:] if started else "(none)"
        pytest.fail(f"the fuzz process died (return code {proc.returncode}) in case {last!r}; "
                    f"stderr: {proc.stderr[-2000:]}")
    results = json.loads(lines[-1][len("RESULTS "):])
    failures = [f"{case}: {outcome}" for case, outcome in results if outcome != "ok"]
    assert len(results) > 500
    assert not failures, f"{len(failures)} of {len(results)} cases failed:\n" + "\n".join(
        failures[:40])
