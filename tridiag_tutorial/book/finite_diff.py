"""Finite-difference derivatives: the reference that analytic gradients are checked against.

Chapter 1 of the tutorial uses these helpers to show how finite differences behave, and the
project's tests use :func:`numerical_gradient` to check hand-written backward formulas.

Public functions
----------------
forward_difference(f, x, h)
    ``(f(x + h) - f(x)) / h``; error O(h).
central_difference(f, x, h)
    ``(f(x + h) - f(x - h)) / (2 h)``; error O(h**2).
optimal_step(kind, eps=None, *, scale=1.0, dtype=torch.float64)
    The rule-of-thumb step that balances truncation and round-off error.
numerical_gradient(fn, inputs, eps=1e-6)
    Central-difference gradient of a scalar-valued torch function with respect to each of
    several tensors (float64).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

__all__ = ["forward_difference", "central_difference", "optimal_step", "numerical_gradient"]


def _check_step(h, name: str = "h") -> float:
    """Return ``h`` as a float after checking that it is a positive, finite real number."""
    if isinstance(h, bool) or not isinstance(h, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(h).__name__}")
    h = float(h)
    if not (h > 0 and math.isfinite(h)):
        raise ValueError(f"{name} must be positive and finite, got {h!r}")
    return h


def forward_difference(f: Callable, x, h: float):
    """Forward-difference estimate of the derivative of ``f`` at ``x``.

    Computes ``(f(x + h) - f(x)) / h``. By Taylor's theorem
    ``f(x + h) = f(x) + h f'(x) + h**2/2 f''(xi)``, so the truncation error is
    ``h/2 * |f''(xi)|``: first order in ``h``.

    Args:
        f: a function of one argument; when ``x`` is a tensor (or NumPy array) ``f`` must act
            elementwise, e.g. ``torch.sin``.
        x: a Python/NumPy number, or a tensor of any shape (use float64).
        h: the step, a positive real number.

    Returns:
        The estimate, with the type and shape of ``f(x)``.

    Raises:
        TypeError: if ``h`` is not a real number.
        ValueError: if ``h`` is not positive and finite.

    Example:
        >>> import math
        >>> estimate = forward_difference(math.exp, 0.0, 1e-4)
        >>> round(estimate, 6)  # exp'(0) = 1; the error is about h/2
        1.00005
    """
    h = _check_step(h)
    # [book: forward-difference]
    return (f(x + h) - f(x)) / h
    # [/book: forward-difference]


def central_difference(f: Callable, x, h: float):
    """Central-difference estimate of the derivative of ``f`` at ``x``.

    Computes ``(f(x + h) - f(x - h)) / (2 h)``. The even Taylor terms cancel, leaving a
    truncation error of ``h**2/6 * |f'''(xi)|``: second order in ``h``. Arguments, result and
    errors are those of :func:`forward_difference`.

    Example:
        >>> x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
        >>> estimate = central_difference(torch.sin, x, 1e-5)
        >>> estimate.shape
        torch.Size([3])
        >>> bool(torch.allclose(estimate, torch.cos(x), rtol=0, atol=1e-9))
        True
    """
    h = _check_step(h)
    # [book: central-difference]
    return (f(x + h) - f(x - h)) / (2 * h)
    # [/book: central-difference]


def optimal_step(kind: str, eps: float | None = None, *, scale: float = 1.0,
                 dtype: torch.dtype = torch.float64) -> float:
    """Rule-of-thumb step size for a finite difference.

    The total error of a finite difference is truncation error (shrinks with ``h``) plus
    round-off error (grows as ``h`` shrinks: each evaluation of ``f`` is wrong by about
    ``eps * |f|``, and the difference is divided by ``h``). With ``M2 = |f''|``,
    ``M3 = |f'''|`` near ``x``:

    * forward:  ``E(h) ~ h/2 * M2 + 2 eps |f| / h``, minimised at
      ``h* = 2 sqrt(eps |f| / M2)``, i.e. ``h* ~ sqrt(eps)``;
    * central:  ``E(h) ~ h**2/6 * M3 + eps |f| / h``, minimised at
      ``h* = (3 eps |f| / M3)**(1/3)``, i.e. ``h* ~ eps**(1/3)``.

    The constants depend on the unknown derivatives of ``f``; this function returns the
    textbook rule of thumb that drops them: ``scale * sqrt(eps)`` (forward) or
    ``scale * eps**(1/3)`` (central). ``scale`` is the size over which ``f`` changes,
    commonly ``max(1, |x|)``.

    Args:
        kind: ``"forward"`` or ``"central"``.
        eps: the relative precision of the function values; by default the machine
            epsilon of ``dtype`` (2.2e-16 for float64).
        scale: a positive number, the characteristic scale of ``x``.
        dtype: a floating-point dtype whose machine epsilon is used when ``eps`` is None.

    Returns:
        The step, a Python float.

    Raises:
        ValueError: for an unknown ``kind``, or ``eps``/``scale`` not positive and finite.
        TypeError: for a non-numeric ``eps``/``scale`` or a non-floating ``dtype``.

    Example:
        >>> f"{optimal_step('forward'):.2e}", f"{optimal_step('central'):.2e}"
        ('1.49e-08', '6.06e-06')
        >>> f"{optimal_step('central', eps=1e-15, scale=10.0):.3g}"  # 10 * (1e-15)**(1/3)
        '0.0001'
    """
    if kind not in ("forward", "central"):
        raise ValueError(f"kind must be 'forward' or 'central', got {kind!r}")
    if eps is None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        eps = torch.finfo(dtype).eps
    eps = _check_step(eps, "eps")
    scale = _check_step(scale, "scale")
    if kind == "forward":
        return scale * math.sqrt(eps)
    return scale * eps ** (1 / 3)


def numerical_gradient(fn: Callable[..., torch.Tensor],
                       inputs: torch.Tensor | Sequence[torch.Tensor],
                       eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """Central-difference gradient of a scalar-valued function of several tensors.

    For every element ``x[j]`` of every tensor in ``inputs`` this evaluates
    ``(fn(..., x + eps e_j, ...) - fn(..., x - eps e_j, ...)) / (2 eps)``, so it calls ``fn``
    ``2 * (total number of elements) + 1`` times (the extra call checks the output): use it
    on small tests only. The inputs are never modified: each call of ``fn`` receives fresh
    copies. Gradient tracking is off while ``fn`` runs.

    Args:
        fn: called as ``fn(*inputs)``; must return a tensor with exactly one element.
        inputs: a float64 tensor, or a tuple/list of float64 tensors (any shapes, e.g.
            ``(n,)`` and ``(n, n)``), on any device.
        eps: the step, a positive real number (1e-6 suits float64, as in ``gradcheck``).

    Returns:
        A tuple with one float64 tensor per input, with that input's shape and device:
        the partial derivatives of ``fn`` with respect to its elements.

    Raises:
        TypeError: if an input is not a float64 tensor, or ``fn`` does not return a tensor.
        ValueError: if ``inputs`` is empty, ``eps`` is not positive, or ``fn`` returns a
            tensor with more than one element.

    Example:
        >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> A = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
        >>> gx, gA = numerical_gradient(lambda x, A: x @ A @ x, (x, A))
        >>> gx.shape, gA.shape
        (torch.Size([2]), torch.Size([2, 2]))
        >>> bool(torch.allclose(gx, (A + A.T) @ x))  # d(x^T A x)/dx = (A + A^T) x
        True
        >>> bool(torch.allclose(gA, torch.outer(x, x)))  # d(x^T A x)/dA = x x^T
        True
    """
    eps = _check_step(eps, "eps")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise ValueError("inputs must contain at least one tensor")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float64:
            raise TypeError(f"inputs[{i}] has dtype {t.dtype}; numerical_gradient needs float64 "
                            "(call .double() first): in lower precision, round-off swamps the result")

    # Private contiguous copies: perturbing them never touches the caller's tensors.
    base = [t.detach().clone(memory_format=torch.contiguous_format) for t in inputs]

    def evaluate() -> float:
        out = fn(*(b.clone() for b in base))  # fresh copies, in case fn works in place
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"fn must return a tensor, got {type(out).__name__}")
        if out.numel() != 1:
            raise ValueError(f"fn must return a scalar (one element), got shape {tuple(out.shape)}")
        return out.item()

    grads = []
    with torch.no_grad():
        evaluate()  # check the output once, even if every input is empty
        for b in base:
            flat = b.view(-1)
            grad = torch.empty_like(b)
            grad_flat = grad.view(-1)
            for j in range(flat.numel()):
                original = flat[j].item()
                flat[j] = original + eps
                f_plus = evaluate()
                flat[j] = original - eps
                f_minus = evaluate()
                flat[j] = original  # restore exactly, not by adding eps back
                grad_flat[j] = (f_plus - f_minus) / (2 * eps)
            grads.append(grad)
    return tuple(grads)
