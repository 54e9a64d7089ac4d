"""The private torch APIs that the composition machinery of :mod:`tridiag_tutorial.functions` and :mod:`tridiag_tutorial.registration` needs, in
one place, each with what it detects. ``tests/test_compat.py`` fails loudly if a torch release
removes or renames one of them.

Why private APIs at all: whether a ``torch.func`` transform is active, and which ones, is not
exposed publicly, and the only way to give a ``torch.library`` op an autograd kernel that works
under ``torch.func`` transforms traced by ``torch.compile`` is the single-level autograd.Function
that functorch itself uses for the same purpose (``torch/_functorch/autograd_function.py``).
"""

from __future__ import annotations

import torch
from torch._C import _functorch
from torch._C._functorch import TransformType
from torch._functorch import eager_transforms as _eager_transforms
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._functorch.utils import enable_single_level_autograd_function, unwrap_dead_wrappers
from torch.autograd import forward_ad
from torch.utils._device import DeviceContext  # private: torch.set_default_device's mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["SingleLevelFunction", "enable_single_level_autograd_function",
           "forward_transform_depth", "differentiation_depth", "mode_active", "transform_active",
           "forward_ad_active", "is_functorch_tensor", "innermost", "jvp_nesting",
           "forward_grad_enabled",
           "outer_autograd_records",
           "function_apply", "base_apply",
           "unwrap_dead_wrappers", "PYTHON_FUNCTION_APPLY"]

#: An ``autograd.Function`` whose ``apply`` records one autograd node on the tensors it is given,
#: at the current functorch level, without functorch's ``custom_function_call`` (which needs the
#: functorch layer that dispatching an op to its Autograd kernel has already peeled off). functorch
#: builds its per-level functions on this class; ``apply`` must run inside
#: :func:`enable_single_level_autograd_function` while any transform is active.
SingleLevelFunction = torch.autograd.function._SingleLevelFunction


def forward_transform_depth() -> int:
    """How many ``torch.func`` forward-mode transforms (``jvp``, ``jacfwd``, ``hessian``'s outer
    ``jacfwd``) are active right now."""
    return sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def forward_grad_enabled() -> bool:
    """Forward AD is on (``autograd.Function.forward`` turns it off while it runs)."""
    return torch._C._is_fwd_grad_enabled()


def innermost(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor under every functorch wrapper (transforms' and vmap's): what ordinary autograd,
    below every ``torch.func`` level, sees."""
    while t is not None and is_functorch_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def jvp_nesting() -> int:
    """How many ``torch.func.jvp`` calls (``jacfwd``'s included) are running, counted in Python
    by functorch itself (``eager_transforms.JVP_NESTING``): unlike the interpreter stack, which a
    kernel below the transforms sees popped, it stays set while their kernels run."""
    return _eager_transforms.JVP_NESTING


def differentiation_depth() -> int:
    """How many differentiating ``torch.func`` transforms (``grad``/``vjp``/``jacrev`` and
    ``jvp``/``jacfwd``) are active right now; ``vmap`` levels do not count."""
    return sum(i.key() in (TransformType.Grad, TransformType.Jvp)
               for i in retrieve_all_functorch_interpreters())


def any_tangent(tensors) -> bool:
    """Some tensor among ``tensors`` (other items are skipped) carries a forward-AD tangent of
    the active ``dual_level``. ``unpack_dual`` may raise ``RuntimeError`` below autograd (under
    ``make_fx``); callers that can meet that case handle it."""
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
               for t in tensors)


def outer_autograd_records(*tensors: torch.Tensor | None) -> bool:
    """Ordinary autograd, below every ``torch.func`` level, records this call: some input's
    innermost tensor (under every functorch wrapper) requires grad while grad mode was on outside
    the transforms (the outermost ``grad`` level's saved mode, else the current one), or carries
    a forward-AD tangent of a ``dual_level``. A single-level Function attaches its derivative to
    the innermost transform only, so that record would miss the call's derivative."""
    grad_mode = torch.is_grad_enabled()
    for interpreter in retrieve_all_functorch_interpreters():  # outermost first
        if interpreter.key() == TransformType.Grad:
            grad_mode = interpreter.prev_grad_mode()
            break
    dual = forward_ad_active()
    if not (grad_mode or dual):
        return False
    for t in map(innermost, tensors):
        if t is None:
            continue
        if grad_mode and t.requires_grad:
            return True
        if dual and forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False


# The fast path's checks (functions._direct, functions._unobserved): is anything but the result watching?
def mode_active() -> bool:
    """A ``TorchDispatchMode`` (FakeTensorMode, FlopCounterMode, ...) or a ``TorchFunctionMode``
    is installed: the call must go through the dispatcher so that the mode sees it. Torch's
    ``DeviceContext`` (``torch.set_default_device``, ``with torch.device(...)``) does not count:
    it only sets where factory functions allocate, and a solve of given tensors calls none that
    it changes (the kernels allocate like their inputs)."""
    if _get_current_dispatch_mode() is not None:
        return True
    if not torch._C._is_torch_function_mode_enabled():
        return False
    stack = range(torch._C._len_torch_function_stack())  # private: the installed function modes
    return not all(isinstance(torch._C._get_function_stack_at(i), DeviceContext) for i in stack)


def transform_active() -> bool:
    """Some ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is running."""
    return _functorch.peek_interpreter_stack() is not None


def forward_ad_active() -> bool:
    """A ``torch.autograd.forward_ad.dual_level`` is entered: dual tensors may carry tangents."""
    return forward_ad._current_level >= 0


def is_functorch_tensor(t: torch.Tensor) -> bool:
    """``t`` is a functorch wrapper (a transform's tensor, a vmap ``BatchedTensor``, or the
    legacy batched tensor of ``gradcheck``'s batched checks), not plain data."""
    return (_functorch.is_functorch_wrapped_tensor(t) or _functorch.is_batchedtensor(t)
            or _functorch.is_legacy_batchedtensor(t))


_FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]
#: Whether ``Function.apply`` is written in Python (torch 2.13) and binds the arguments with
#: :mod:`inspect` before it calls the C++ ``_FunctionBase.apply``. From torch 2.14 ``apply`` is the
#: C++ method itself, and :func:`function_apply` is then just ``cls.apply``.
PYTHON_FUNCTION_APPLY = torch.autograd.Function.__dict__.get("apply") is not _FUNCTION_BASE_APPLY


def base_apply(cls):
    """The C++ ``_FunctionBase.apply`` bound to ``cls``: ``cls.apply`` without its Python layer,
    for a caller that knows no ``torch.func`` transform is active and has unwrapped dead functorch
    wrappers (:func:`unwrap_dead_wrappers`), which is all that layer then does besides binding
    arguments for a ``setup_context`` (none here: positional arguments only)."""
    return _FUNCTION_BASE_APPLY.__get__(None, cls)


# [book: function-apply]
def function_apply(cls, *args):
    """``cls.apply(*args)`` for an ``autograd.Function`` with ``setup_context``, positional
    arguments only, without the :mod:`inspect` binding of the arguments to ``forward``'s
    signature that torch 2.13's ``Function.apply`` performs on every such call (chapter 13 measures it).
    Without a ``torch.func`` transform, that ``apply`` does exactly this after the binding: unwrap
    dead functorch wrappers and call the C++ ``_FunctionBase.apply``; under a transform, and on
    releases whose ``apply`` is the C++ method itself, this is ``cls.apply``."""
    if not PYTHON_FUNCTION_APPLY or torch._C._are_functorch_transforms_active():
        return cls.apply(*args)
    return base_apply(cls)(*unwrap_dead_wrappers(args))
