"""Chapter 3's claims, recomputed: the band gradients are the three central diagonals of the dense
gradient -v x^H, A^T and A^H are the swapped (and conjugated) bands, the backward rule makes one
solve on them, the conjugations matter for complex inputs, chapter 5's custom op (a backward and a
batch rule, no forward rule) gives zero tangents, with no warning, under torch.func.jvp on this torch version but the
right ones by double backward, torch.func.jvp through special_zeta raises, JAX's tridiagonal solve carries the same rules, and PyTorch's derivatives.yaml pairs both rules for its
dense solve. The complex forward rule needs no conjugation and matches the dense solve's jvp and
gradcheck with check_forward_ad=True. The op's jvp and backward pass the dot-product test
of exercise 2. Where the C++ extension is built, the CPU backward is its fused copy of the rules,
with the same numbers."""

import pathlib
import warnings

import pytest
import torch

from tridiag_tutorial import rules, to_dense, tridiagonal_solve


def bands(n, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lower = torch.randn(n - 1, dtype=dtype, generator=gen)
    upper = torch.randn(n - 1, dtype=dtype, generator=gen)
    diag = 4 + torch.randn(n, dtype=dtype, generator=gen).abs()  # dominant: |diag| > 4 > typical off
    diag = (diag + lower.abs().max() + upper.abs().max()).to(dtype)
    return lower, diag, upper


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_band_gradients_are_the_diagonals_of_minus_v_x_h(dtype):
    lower, diag, upper = bands(7, dtype)
    A = to_dense(lower, diag, upper)
    b = torch.randn(7, 1, dtype=dtype, generator=torch.Generator().manual_seed(1))
    x = torch.linalg.solve(A, b)
    v = torch.linalg.solve(A.mH, torch.ones_like(x))
    dense = -v @ x.mH
    for offset, band in zip((-1, 0, 1), rules.band_gradients(v, x)):
        assert torch.allclose(band, torch.diagonal(dense, offset), rtol=0, atol=1e-14)


def test_transpose_and_adjoint_are_the_swapped_bands():
    lower, diag, upper = bands(5)
    assert torch.equal(to_dense(upper, diag, lower), to_dense(lower, diag, upper).T)
    lower_c, diag_c, upper_c = bands(5, torch.complex128)
    assert torch.equal(to_dense(upper_c.conj(), diag_c.conj(), lower_c.conj()),
                       to_dense(lower_c, diag_c, upper_c).mH)


def test_solve_backward_makes_one_solve_on_the_swapped_conjugated_bands():
    lower, diag, upper = bands(6, torch.complex128)
    B = torch.randn(6, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    X = tridiagonal_solve(lower, diag, upper, B)
    G = torch.randn(6, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(3))
    calls = []

    def recording_solve(*args):
        calls.append(args[:3])
        return tridiagonal_solve(*args)

    grads = rules.solve_backward(recording_solve, lower, diag, upper, X, G)
    ((l_, d_, u_),) = calls
    assert torch.equal(l_, upper.conj()) and torch.equal(d_, diag.conj()) and torch.equal(u_, lower.conj())
    for a, b in zip(rules.band_gradients(grads[3], X), grads[:3]):
        assert torch.equal(a, b)


def test_forgetting_the_conjugations_gives_wrong_complex_gradients():
    lower, diag, upper = bands(6, torch.complex128)
    gen = torch.Generator().manual_seed(4)
    b, t = (torch.randn(6, dtype=torch.complex128, generator=gen) for _ in range(2))
    leaves = [p.clone().requires_grad_() for p in (lower, diag, upper, b)]
    x = tridiagonal_solve(*leaves)
    (x - t).abs().square().sum().backward()
    A, xd = to_dense(lower, diag, upper), x.detach()
    v_wrong = torch.linalg.solve(A.T, 2 * (xd - t))
    assert (-v_wrong * xd - leaves[1].grad).abs().max() > 0.1 * leaves[1].grad.abs().max()
    v_right = torch.linalg.solve(A.mH, 2 * (xd - t))
    assert torch.allclose(-v_right * xd.conj(), leaves[1].grad, rtol=0, atol=1e-12)


def test_a_custom_op_without_a_forward_rule_gives_zero_tangents():
    from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op

    lower, diag, upper = bands(6)
    gen = torch.Generator().manual_seed(5)
    b = torch.randn(6, dtype=torch.float64, generator=gen)
    tangents = tuple(torch.randn_like(p) for p in (lower, diag, upper, b))
    # the final op first: torch.func's first use in a process warns about torch.jit.script, not the op
    _, dx_final = torch.func.jvp(tridiagonal_solve, (lower, diag, upper, b), tangents)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, dx_custom = torch.func.jvp(tridiagonal_solve_custom_op, (lower, diag, upper, b), tangents)
    if torch.__version__.startswith("2.13"):  # the chapter's claim, on the torch it ran with
        assert caught == []
    A, x = to_dense(lower, diag, upper), tridiagonal_solve(lower, diag, upper, b)
    dx = torch.linalg.solve(A, tangents[3] - to_dense(*tangents[:3]) @ x)
    assert torch.all(dx_custom == 0) and dx.abs().max() > 0.01
    assert torch.allclose(dx_final, dx, rtol=0, atol=1e-12)


def test_the_double_backward_trick_gives_the_custom_ops_tangent():
    from tridiag_tutorial.book.custom_op import tridiagonal_solve_custom_op

    lower, diag, upper = bands(7, seed=3)
    gen = torch.Generator().manual_seed(6)
    b = torch.randn(7, dtype=torch.float64, generator=gen)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in (lower, diag, upper, b))
    _, dx_double = torch.autograd.functional.jvp(tridiagonal_solve_custom_op, (lower, diag, upper, b), tangents)
    A, x = to_dense(lower, diag, upper), tridiagonal_solve(lower, diag, upper, b)
    dx = torch.linalg.solve(A, tangents[3] - to_dense(*tangents[:3]) @ x)
    assert dx.abs().max() > 0.01
    assert torch.allclose(dx_double, dx, rtol=0, atol=1e-12)


def test_derivatives_yaml_pairs_a_reverse_and_a_forward_rule_for_the_dense_solve():
    torchgen = pytest.importorskip("torchgen")
    path = pathlib.Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    if not path.exists():
        pytest.skip("this torch wheel ships no derivatives.yaml")
    (entry,) = [e for e in path.read_text().split("\n\n") if e.strip().startswith("- name: _linalg_solve_ex(")]
    assert "A, B: linalg_solve_backward(grad, result, A, LU, pivots" in entry
    assert 'result: "linalg_solve_jvp(A_t, B_t, result, LU, pivots' in entry


def test_finite_differences_agree_with_the_band_gradients_below_the_printed_bound():
    from tridiag_tutorial.book.finite_diff import numerical_gradient

    n, k = 7, 3
    lower, diag, upper = bands(n)
    gen = torch.Generator().manual_seed(2)
    B = torch.randn(n, k, dtype=torch.float64, generator=gen)
    T = torch.randn(n, k, dtype=torch.float64, generator=gen)

    def loss(lower, diag, upper, B):
        return 0.5 * (torch.linalg.solve(to_dense(lower, diag, upper), B) - T).square().sum()

    X = tridiagonal_solve(lower, diag, upper, B)
    grads = rules.solve_backward(tridiagonal_solve, lower, diag, upper, X, X - T)
    for mine, fd in zip(grads, numerical_gradient(loss, (lower, diag, upper, B))):
        assert (mine - fd).abs().max() < 1e-8


def test_jaxs_tridiagonal_solve_carries_this_chapters_rules():
    jax = pytest.importorskip("jax")
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    n = 6
    lower, diag, upper = bands(n)
    gen = torch.Generator().manual_seed(3)
    b, g = torch.randn(n, dtype=torch.float64, generator=gen), torch.randn(n, dtype=torch.float64, generator=gen)
    d_bands = [torch.randn_like(p) for p in (lower, diag, upper)]
    db = torch.randn(n, dtype=torch.float64, generator=gen)

    def jax_bands(lo, d, up):
        return np.concatenate([[0.0], lo.numpy()]), d.numpy(), np.concatenate([up.numpy(), [0.0]])

    primals = (*jax_bands(lower, diag, upper), b.numpy()[:, None])
    solve = jax.lax.linalg.tridiagonal_solve
    _, dx_jax = jax.jvp(solve, primals, (*jax_bands(*d_bands), db.numpy()[:, None]))
    A = to_dense(lower, diag, upper)
    x = torch.linalg.solve(A, b)
    dx = torch.linalg.solve(A, db - to_dense(*d_bands) @ x)
    assert np.abs(np.asarray(dx_jax)[:, 0] - dx.numpy()).max() < 1e-12
    grads = jax.grad(lambda *p: (solve(*p)[:, 0] * g.numpy()).sum(), argnums=(0, 1, 2, 3))(*primals)
    v = torch.linalg.solve(A.T, g)
    ours = [-v[1:] * x[:-1], -v * x, -v[:-1] * x[1:], v]
    theirs = [np.asarray(grads[0])[1:], np.asarray(grads[1]), np.asarray(grads[2])[:-1], np.asarray(grads[3])[:, 0]]
    for mine, jx in zip(ours, theirs):
        assert np.abs(mine.numpy() - jx).max() < 1e-12


def test_forward_mode_through_special_zeta_raises():
    torchgen = pytest.importorskip("torchgen")
    path = pathlib.Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    if path.exists():
        (entry,) = [e for e in path.read_text().split("\n\n") if e.strip().startswith("- name: special_zeta(")]
        assert "result:" not in entry
    q = torch.tensor([1.5, 2.0], dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(lambda q: torch.special.zeta(torch.full_like(q, 3.0), q), (q,), (torch.ones_like(q),))


def test_the_complex_forward_rule_needs_no_conjugation():
    lower, diag, upper = bands(6, torch.complex128, seed=7)
    gen = torch.Generator().manual_seed(8)
    b = torch.randn(6, dtype=torch.complex128, generator=gen)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in (lower, diag, upper, b))
    A = to_dense(lower, diag, upper)
    x = torch.linalg.solve(A, b)
    dx = torch.linalg.solve(A, tangents[3] - to_dense(*tangents[:3]) @ x)
    _, dx_dense = torch.func.jvp(lambda lo, d, up, rhs: torch.linalg.solve(to_dense(lo, d, up), rhs),
                                 (lower, diag, upper, b), tangents)
    _, dx_package = torch.func.jvp(tridiagonal_solve, (lower, diag, upper, b), tangents)
    assert torch.allclose(dx, dx_dense, rtol=0, atol=1e-12)
    assert torch.allclose(dx_package, dx_dense, rtol=0, atol=1e-12)
    dx_conjugated = torch.linalg.solve(A, tangents[3] - to_dense(*tangents[:3]).conj() @ x)
    assert (dx_conjugated - dx_dense).abs().max() > 0.01
    inputs = [p.clone().requires_grad_() for p in (lower, diag, upper, b)]
    assert torch.autograd.gradcheck(tridiagonal_solve, inputs, check_forward_ad=True)


def test_the_ops_jvp_and_backward_pass_the_dot_product_test():
    """Exercise 2: <g, J u> from the op's jvp equals <J^T g, u> from its backward (torch.func.vjp)."""
    lower, diag, upper = bands(9, seed=9)
    gen = torch.Generator().manual_seed(10)
    b, g = (torch.randn(9, dtype=torch.float64, generator=gen) for _ in range(2))
    primals = (lower, diag, upper, b)
    direction = tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in primals)
    _, dx = torch.func.jvp(tridiagonal_solve, primals, direction)
    _, vjp_fn = torch.func.vjp(tridiagonal_solve, *primals)
    lhs = torch.dot(g, dx)
    rhs = sum(torch.dot(r, u) for r, u in zip(vjp_fn(g), direction))
    assert lhs.abs() > 0.01
    assert abs(lhs - rhs) < 1e-12 * max(1.0, lhs.abs().item())


def test_a_library_operator_gets_a_forward_rule_from_its_autograd_kernel():
    """Section 3.10: a torch.library operator whose Autograd kernel is an autograd.Function with a
    jvp gives the right tangents under torch.func.jvp (not the zeros of a custom_op)."""
    import tridiag_tutorial.registration  # noqa: F401  (registers tridiag_tutorial::solve)

    lower, diag, upper = bands(6, seed=7)
    gen = torch.Generator().manual_seed(8)
    b = torch.randn(6, 1, dtype=torch.float64, generator=gen)
    tangents = tuple(torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in (lower, diag, upper, b))

    def op(lower, diag, upper, b):
        return torch.ops.tridiag_tutorial.solve(lower, diag, upper, b, None, None, "N", "lapack")

    _, dx_op = torch.func.jvp(op, (lower, diag, upper, b), tangents)
    A, x = to_dense(lower, diag, upper), tridiagonal_solve(lower, diag, upper, b)
    dx = torch.linalg.solve(A, tangents[3] - to_dense(*tangents[:3]) @ x)
    assert dx.abs().max() > 0.01
    assert torch.allclose(dx_op, dx, rtol=0, atol=1e-12)


def _solved_with_gradients(seed, n=7, k=3):
    """A system with k columns solved by the package, and .backward() of 0.5 |X - T|^2: the bands,
    T, the leaves (with their .grad) and X, detached."""
    lower, diag, upper = bands(n, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, T = (torch.randn(n, k, dtype=torch.float64, generator=gen) for _ in range(2))
    leaves = [p.clone().requires_grad_() for p in (lower, diag, upper, B)]
    X = tridiagonal_solve(*leaves)
    (0.5 * (X - T).square().sum()).backward()
    return lower, diag, upper, T, leaves, X.detach()


def test_the_package_backward_equals_the_formulas_with_several_columns():
    """Section 3.4: the package column of the table is exactly zero (same solve, same products)."""
    lower, diag, upper, T, leaves, X = _solved_with_gradients(seed=9)
    V = tridiagonal_solve(upper, diag, lower, X - T)
    ours = [-(V[1:] * X[:-1]).sum(-1), -(V * X).sum(-1), -(V[:-1] * X[1:]).sum(-1), V]
    for mine, leaf in zip(ours, leaves):
        assert torch.equal(mine, leaf.grad)


def test_the_prose_quotes_the_printed_backward_forward_ratio():
    """Section 3.7's prose quotes the median ratio that the timing cell printed in the run shown."""
    import json
    import re

    path = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "03_adjoint.ipynb"
    cells = json.loads(path.read_text())["cells"]
    printed = [m.group(1) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
               for m in [re.search(r"backward / forward per round: median (\d+\.\d+)", "".join(o.get("text", "")))]
               if m]
    assert len(printed) == 1
    quoted = [c for c in cells if c["cell_type"] == "markdown" and "times as long as the forward" in "".join(c["source"])]
    assert len(quoted) == 1
    assert f"a median {printed[0]} times as long" in "".join(quoted[0]["source"]).replace("\n", " ")


def test_the_cpu_backward_of_sections_3_4_and_3_7_is_the_fused_cpp_copy(monkeypatch):
    """Sections 3.4 and 3.9: where the C++ extension is built, the package column's CPU backward
    is one call of the fused C++ backward, not rules.solve_backward, and still equals the formulas."""
    from tridiag_tutorial import cpp_available
    from tridiag_tutorial.kernels import compiled

    if not cpp_available():
        pytest.skip("the C++ extension is not built")
    calls = []
    fused, python = compiled.solve_backward, rules.solve_backward
    monkeypatch.setattr(compiled, "solve_backward", lambda *a: calls.append("cpp") or fused(*a))
    monkeypatch.setattr(rules, "solve_backward", lambda *a: calls.append("python") or python(*a))
    lower, diag, upper, T, leaves, X = _solved_with_gradients(seed=11)
    assert calls == ["cpp"]
    V = python(tridiagonal_solve, lower, diag, upper, X, X - T)[3]
    ours = [-(V[1:] * X[:-1]).sum(-1), -(V * X).sum(-1), -(V[:-1] * X[1:]).sum(-1), V]
    for mine, leaf in zip(ours, leaves):
        assert torch.equal(mine, leaf.grad)
