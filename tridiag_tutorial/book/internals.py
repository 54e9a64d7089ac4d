"""The library's internals that the chapters call, under the names the chapters use.

Chapter 13 takes the op apart (validation, then the differentiable solve of validated inputs) and
chapter 13 times the call that skips ``Function.apply``'s argument binding. They import these
names from here, so that renaming a private function of the library changes this module, which the
tests import, and no chapter.
"""

from .._compat import function_apply
from .._validation import validate
from ..functions import _differentiable_solve as differentiable_solve

__all__ = ["differentiable_solve", "function_apply", "validate"]
