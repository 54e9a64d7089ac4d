"""Shared test helpers: one tolerance table keyed by dtype, seeded random systems, kernels."""

import contextlib

import pytest
import torch

from tridiag_tutorial import kernels
from tridiag_tutorial.reference import dense_solve

# Tolerances for comparing a tridiagonal solve with the dense reference, keyed by dtype.
# Single precision is looser: both solvers round, and condition numbers here reach ~1e2.
TOL = {
    torch.float32: dict(rtol=2e-4, atol=2e-5),
    torch.complex64: dict(rtol=2e-4, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.complex128: dict(rtol=1e-10, atol=1e-12),
}
REAL_DTYPES = [torch.float32, torch.float64]

# Tests that pin a bug of torch itself run only on the releases where it was measured; on any
# other release they are skipped (with this reason), not silently passed or failed.
TRAP_MEASURED_ON = ("2.13.", "2.14.")
torch_trap = pytest.mark.skipif(
    not torch.__version__.startswith(TRAP_MEASURED_ON),
    reason=f"this torch bug was measured on torch {', '.join(v[:-1] for v in TRAP_MEASURED_ON)} only")
ALL_DTYPES = REAL_DTYPES + [torch.complex64, torch.complex128]


def assert_close(actual, expected, dtype=None):
    dtype = dtype or expected.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def torch_ops_driver(n: int) -> str:
    """The driver that a device other than the CPU gets for systems of ``n`` unknowns: the
    kernels in torch ops (the CUDA code path), run here on the CPU."""
    return kernels.choose_driver("cuda", torch.float64, 1, n, False)


def driver_for(kernel: str, n: int):
    """``"torch"``: the kernels in torch ops that another device would run; ``"lapack"``: LAPACK."""
    return torch_ops_driver(n) if kernel == "torch" else "lapack"


def assert_grads_match_dense(grads, args, loss, dtype=None):
    """``grads`` of ``loss(x)`` w.r.t. ``args`` equal the dense reference's, with TOL[dtype]."""
    expected = torch.autograd.grad(loss(dense_solve(*args)), args)
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        assert_close(g, e, dtype)


def make_system(n, batch=(), k=None, dtype=torch.float64, seed=0, dominant=False,
                requires_grad=False):
    """Random ``(lower, diag, upper, rhs)``; ``rhs`` is ``(*batch, n)`` if ``k`` is None.

    ``dominant=False`` gives matrices that are not diagonally dominant (so pivoting matters),
    yet well conditioned enough for float32 comparisons: the diagonal is 1.5 + |N(0, 1)| with a
    random sign, the off-diagonals N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)
    real = torch.float32 if dtype in (torch.float32, torch.complex64) else torch.float64

    def randn(*shape):
        x = torch.randn(*shape, generator=g, dtype=real)
        if dtype.is_complex:
            x = torch.complex(x, torch.randn(*shape, generator=g, dtype=real))
        return x

    lower, upper = randn(*batch, n - 1), randn(*batch, n - 1)
    sign = torch.where(torch.rand(*batch, n, generator=g) < 0.5, -1.0, 1.0).to(real)
    diag = (1.5 + randn(*batch, n).abs()) * sign
    if dominant:
        diag = diag + 4 * sign
    rhs = randn(*batch, n) if k is None else randn(*batch, n, k)
    out = [t.to(dtype) for t in (lower, diag, upper, rhs)]
    return [t.requires_grad_() for t in out] if requires_grad else out


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Compiled state left by one test (explain, compile caches) must not leak into another."""
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def one_rank_group(timeout_s: float = 60):
    """A gloo process group of one rank in this process (an in-memory store: no port), destroyed
    on exit: the split solve with P = 1, and what it refuses before any collective."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def require_cpp():
    """Skip unless the C++ kernel was built at install. Where it should have been built (in CI,
    ``CI=true``, or wherever a C++ compiler is on PATH: ``make test`` installs with one), its
    absence is a test failure, not a skip, so a broken build cannot hide."""
    import os
    import shutil

    from tridiag_tutorial.kernels import compiled

    if compiled.is_available():
        return
    if compiled.DISABLED:  # switched off on purpose (TRIDIAG_TUTORIAL_NO_CPP=1)
        pytest.skip(f"the C++ kernel is {compiled.BUILD_ERROR}")
    in_ci = os.environ.get("CI", "").lower() == "true"
    has_compiler = shutil.which(os.environ.get("CXX", "c++")) is not None
    if in_ci or has_compiler:
        pytest.fail(f"the C++ kernel was not built although a compiler is here: "
                    f"{compiled.BUILD_ERROR}", pytrace=False)
    pytest.skip(f"the C++ kernel was not built at install: {compiled.BUILD_ERROR}")


# The four kernels a CPU solve can run on: the values of the public functions' ``driver``.
KERNELS = list(kernels.DRIVERS)


# ----------------------------------------------------------------------------------------------
# The `slow` marker (registered in pyproject.toml). `make check` runs `-m "not book and not slow"`
# (about three minutes on a 2-core machine: see the Makefile), `make unit` runs everything. The marks
# are set here by name, so that the test files need none (a test may still carry
# @pytest.mark.slow itself). Seconds: `pytest --durations` on the 2-core development machine,
# which was busy: rough figures (two figures: a quiet and a busy run).
# A whole module is slow only when it has no fast test: every other module keeps its fast ones.
SLOW_MODULES = {
    "test_fuzz",  # subprocess fuzz of every entry point on every driver (20 s, the whole module)
    "test_chapters_without_cpp",  # runs seven chapters with nbclient, each in a fresh kernel
}
# "module::function": every parametrization of that test function; "module::function[prefix":
# those whose parameter ids start with the prefix, where `*` stands for any characters (so
# "[*-10007-" picks the cases of n = 10007 whatever the parameters before it).
SLOW_TESTS = {
    # builds/compiles: torch.compile (Dynamo, AOTAutograd, Inductor) on many graphs
    "test_kernel_matrix::test_composition_compiled",  # 96 compiled compositions x kernels (32 s)
    "test_compositions::test_composition[compile",  # the compiled modes; eager stays (10 s)
    "test_compile::test_inductor_compiles_and_matches",  # Inductor generates and builds C++ (16 s)
    "test_compositions::test_jacfwd_compiles_with_dynamic_shapes",  # 8 dynamic-shape graphs (9 s)
    "test_compositions::test_vmap_of_jvp_over_rhs_compiles_with_dynamic_shapes",  # (2 s)
    "test_factorization::test_compile_fullgraph_forward_and_backward",  # (4 s)
    "test_factorization::test_compile_fullgraph_on_the_pure_torch_kernel",  # (3 s)
    "test_kernels::test_compiled_function_recompiles_for_another_driver",  # (3 s)
    "test_compositions::test_compiled_automatic_choice_follows_the_shapes",  # (3 s)
    "test_compositions::test_transform_outside_a_compiled_function",  # (2 s)
    "test_compositions::test_compiled_function_follows_the_driver_it_is_given",  # (2 s)
    "test_partitioned::test_sequential_driver_keeps_the_sequential_kernel",  # fullgraph (3 s)
    "test_partitioned::test_compiled_on_the_partitioned_kernel",  # (3 s)
    "test_compile::test_chapter4_function_breaks_the_graph",  # (1.5 s)
    "test_compile::test_backward_compiles_fullgraph_with_compiled_autograd",  # (1 s)
    "test_compile::test_compiled_fullgraph_gradients_equal_eager[2]",  # k = None stays (1-2 s)
    "test_compositions::test_backward_runs_on_the_forwards_kernel[compiled-",  # eager stays (1-2 s)
    "test_compiled::test_compile_fullgraph_on_the_kernel",  # (3 s)
    # subprocesses: each fresh interpreter imports torch (2 to 4 s)
    "test_install::test_import_loads_no_dynamo_and_builds_nothing",  # fresh interpreters (20 s)
    "test_install::test_import_costs_little_more_than_torch",  # the same fixture
    "test_install::test_without_extension_the_package_says_why",  # a child without _C (18 s)
    "test_install::test_without_extension_every_driver_but_cpp_solves",  # the same fixture
    "test_install::test_without_extension_cpp_driver_says_how_to_fix_it",  # the same fixture
    "test_install::test_without_extension_python_defines_the_schemas",  # the same fixture
    "test_install::test_without_extension_compile_and_gradcheck",  # the same fixture
    "test_install::test_cpp_library_works_without_the_python_package",  # a child process (4 s)
    "test_pieces::test_sixteen_byte_lanes_pass_the_same_tests",  # a child pytest run (20-25 s)
    "test_pieces::test_spikes_stop_before_subnormal_numbers",  # g++ builds two probes (8 s)
    # gloo process groups: 2 and 4 spawned ranks, each a fresh interpreter importing torch
    "test_sharding::test_dtensor_solve_and_factorization",  # one job per world size (10-20 s)
    "test_sharding::test_in_a_fresh_process_the_ops_fail_until_the_rules_are_registered",
    # test_distributed_solve: every test that reads the module's two spawned jobs (10-20 s each)
    "test_distributed_solve::test_forward_within_ten_times_lapack",
    "test_distributed_solve::test_nearly_singular_piece_within_ten_times_lapack",
    "test_distributed_solve::test_complex_matches_lapack",
    "test_distributed_solve::test_batch_with_broadcasting",
    "test_distributed_solve::test_fallback_where_a_piece_is_singular",
    "test_distributed_solve::test_singular_matrix_raises_on_every_rank",
    "test_distributed_solve::test_non_finite_in_its_own_system",
    "test_distributed_solve::test_bad_input_raises_on_every_rank",
    "test_distributed_solve::test_gradients_match_dense",
    "test_distributed_solve::test_gradcheck_of_replicated_wrapper",
    "test_distributed_solve::test_bytes_match_the_formula",
    # builds/compiles and subprocess: AOTInductor compiles a package, a child process loads it
    "test_deploy::test_package_runs_in_a_process_with_only_the_library",
    "test_deploy::test_package_needs_the_library",
    # finite-difference checks at larger sizes and on every kernel (test_grad keeps the fast ones)
    "test_partitioned::test_gradcheck_forward_ad_and_second_order_on_the_partitioned_kernel",  # 31 s
    "test_kernel_matrix::test_gradcheck",  # every kernel and size (6 s)
    "test_kernel_matrix::test_gradgradcheck",  # every kernel and size (6 s)
    # every composition eagerly on every kernel and size: 120 cases (7 s); test_compositions keeps
    # them on the automatic driver, test_kernels the backward of every kernel
    "test_kernel_matrix::test_composition_eager",
    "test_factorization::test_gradcheck_through_the_factors",  # 12 dtype x trans x kernel (8 s)
    # opcheck's full battery on every registered op (test_grad::test_opcheck stays)
    "test_grad::test_opcheck_kernel_ops",  # 24 ops x dtypes (4 s)
    "test_kernel_matrix::test_opcheck",  # on every kernel (2 s)
    "test_compiled::test_opcheck[torch.complex128]",  # float64 stays (0.4-0.9 s)
    "test_compiled::test_gradcheck_forward_ad_and_second_order_on_the_kernel[torch.complex128]",
    # ^ float64 stays (1-2 s)
    # the factored solve and its gradients on every kernel and size (up to n = 1030) against a
    # dense inverse, each transpose, gradcheck where n <= 8: 45 cases (7-8 s); test_factorization
    # keeps each transpose on both factorizations and the gradients, test_kernels LAPACK's factors
    "test_kernel_matrix::test_factorization",
    # the C++ kernel against the dense reference and ?gtsv with k = 3 columns on a batch (40
    # cases, 2-3 s: the reference solves are the cost); k = 3 on one system and one column on
    # the batches stay, in every dtype and size
    "test_compiled::test_matches_dense_and_lapack[3-(3, 4)-",
    "test_compiled::test_matches_dense_and_lapack[3-(5,)-",
    "test_compiled::test_backward_on_the_kernel_matches_dense[*-(2, 3)-4-17-",  # the largest (2 s)
    # accuracy families: many matrix constructions x sizes x dtypes against LAPACK
    "test_partitioned::test_singular_matrix_without_an_exact_zero_pivot_raises",  # 24 cases (15 s)
    "test_partitioned_accuracy::test_singular_constructions_raise_where_lapack_does",  # (4 s)
    "test_partitioned_accuracy::test_nearly_singular_blocks_within_ten_times_lapack",  # (1 s)
    "test_partitioned_accuracy::test_quick_run",  # runs the accuracy benchmark (1.5 s)
    "test_partitioned_accuracy::test_merge_keeps_the_other_kernels",  # the benchmark twice (2-5 s)
    "test_partitioned_accuracy::test_forward_error_within_ten_times_lapack[*-3001-",  # (1 s)
    "test_partitioned_accuracy::test_singular_matrix_with_a_nan_column_raises[float32]",  # (1 s)
    # the pieces kernel against ?gtsv's forward error at n = 10007 and 100003 (9 s: the
    # references in longdouble are the cost); the sizes around PIECES_MIN_N and 4099 stay in
    # every family, dtype and column count (and its sixteen-byte lanes, in a child process, are
    # with the subprocesses above)
    "test_pieces::test_within_ten_times_lapack[*-10007-",
    "test_pieces::test_within_ten_times_lapack[*-100003-",
    "test_pieces::test_small_batch_hands_back_only_the_bad_system[poisson-W-1-",  # 15 x 8e4 (3 s)
    "test_partitioned::test_zero_diagonal_needs_pivoting_at_every_step[1002-",  # 500 stays (2-3 s)
    # n = 1000 against a dense 1000 x 1000 solve, 12 cases (8 s); n = 23 to 100 stay
    "test_partitioned::test_matches_dense[one-1000-",
    "test_partitioned::test_matches_dense[batch-1000-",
    "test_partitioned::test_matches_dense[2d-1000-",
    # operation counts at n = 1e5 under a dispatch mode (3 to 12 s)
    "test_partitioned::test_operation_count_grows_like_log_n",
    "test_partitioned::test_operation_count_through_the_op_forward_and_backward",
    # benchmarks: the three tests of the quick suite's shared fixture (27 s to run the suite)
    "test_benchmarks::test_quick_benchmark_runs_and_writes_json",
    "test_benchmarks::test_quick_benchmark_ends_with_the_interleaved_comparison_with_jax",
    "test_benchmarks::test_quick_time_stepping_experiment_reports_both_strategies",
    "test_benchmarks::test_against_jax_pins_each_thread_count_to_as_many_cores",  # subprocesses
    "test_benchmarks::test_quick_jax_experiment_has_compiled_rows_next_to_eager",  # jax.jit (9 s)
    "test_benchmarks::test_quick_cliffs_experiment",  # runs the cliffs experiment (3 s)
    "test_benchmarks::test_quick_one_system_experiment",  # times one large system (6-11 s)
    "test_benchmarks::test_quick_compiled_kernel_experiment",  # times the C++ kernel (2-4 s)
    "test_benchmarks::test_jax_cpu_calls_name_the_lapack_routine",  # imports and jits JAX (1-3 s)
    "test_benchmarks::test_jax_rows_compute_what_ours_compute",  # imports and jits JAX (2 s)
    # each runs the quick suite to merge its rows into a file (1.5 s each)
    "test_benchmarks::test_merge_without_steps_keeps_the_time_stepping_rows_and_their_machine",
    "test_benchmarks::test_merge_replaces_the_rows_of_cases_measured_again_and_drops_retired_names",
    "test_benchmarks::test_merge_keeps_keys_the_suite_no_longer_produces",  # (2-3 s)
    "test_benchmarks::test_full_run_with_merge_replaces_the_time_stepping_rows_it_measures_again",
    # a child process interrupted with SIGINT while it runs the suite (9 s)
    "test_benchmarks::test_sigint_keeps_the_rows_and_exits_130_without_a_traceback",
}


# `make unit` runs on two pytest-xdist workers (`-n 2 --dist loadgroup`). The tests of a module
# whose module- or session-scoped fixture is expensive (a built book, a wheel, processes started
# for every test) stay on one worker, so that the fixture is built once; and the longest tests
# (a chapter executed top to bottom, a package built and installed: 1 to 5 minutes each) are
# handed out first, so that neither worker is left with one of them at the end.
GROUPED_MODULES = {
    "test_benchmarks", "test_book_html", "test_chapter_13", "test_compiled", "test_deploy",
    "test_distributed_solve", "test_install", "test_multiprocess", "test_pip_install", "test_routes",
}
LONGEST_FIRST = ("test_chapters_without_cpp", "test_pip_install", "test_book_html",
                 "test_chapter_12::test_the_chapter_runs_opened_alone",
                 "test_partitioned::test_gradcheck_forward_ad_and_second_order_on_the_partitioned_kernel",
                 "test_pieces::test_sixteen_byte_lanes_pass_the_same_tests")


def _function(item) -> str:
    """The name of the test function ``item`` runs, without its parameters."""
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def _longest_first(item) -> int:
    """The position in LONGEST_FIRST of the module or test ``item`` belongs to (len if none)."""
    for rank, name in enumerate(LONGEST_FIRST):
        if name in (item.path.stem, f"{item.path.stem}::{_function(item)}"):
            return rank
    return len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of SLOW_MODULES and SLOW_TESTS ``slow`` and those of GROUPED_MODULES with
    their xdist group; put LONGEST_FIRST first; warn about a name in SLOW_TESTS that its module
    no longer defines (a renamed test would silently join `make check`)."""
    import re
    import warnings

    prefixes = [re.compile(".*".join(map(re.escape, name.split("*"))))
                for name in SLOW_TESTS if "[" in name]
    seen = {}
    for item in items:
        module = item.path.stem
        function = _function(item)
        if (module in SLOW_MODULES or f"{module}::{function}" in SLOW_TESTS
                or any(prefix.match(f"{module}::{item.name}") for prefix in prefixes)):
            item.add_marker(pytest.mark.slow)
        if module in GROUPED_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
        if getattr(item, "module", None) is not None:
            seen[module] = item.module
    items.sort(key=_longest_first)  # stable: the rest keep their order
    for name in sorted(SLOW_TESTS):
        module, function = name.split("[")[0].split("::")
        if module in seen and not hasattr(seen[module], function):
            warnings.warn(pytest.PytestWarning(
                f"tests/conftest.py SLOW_TESTS names {name}, which {module}.py no longer defines"))
