"""The reference rows shipped with the package (``tridiag_tutorial.bench.reference``): the two
machines' runs, their spread, and chapter 16's accuracy rows, against the suite's own JSON files."""

import json
from pathlib import Path

import pytest

from tridiag_tutorial.bench import reference

DATA = Path(__file__).resolve().parents[1] / "notebooks" / "data"
SUITE, SECOND, ACCURACY = (DATA / "benchmark_results.json", DATA / "benchmark_results_intel.json",
                           DATA / "accuracy_results.json")
SHIPPED = Path(reference.__file__).with_name(reference.FILE)


@pytest.mark.skipif(not (SUITE.exists() and SECOND.exists() and ACCURACY.exists()),
                    reason="the suite's results are not in this checkout")
def test_the_shipped_file_is_extracted_from_the_three_runs():
    extracted = reference.extract(json.loads(SUITE.read_text()), json.loads(ACCURACY.read_text()),
                                  json.loads(SECOND.read_text()))
    assert json.loads(SHIPPED.read_text()) == json.loads(json.dumps(extracted))


def test_each_run_names_another_cpu_and_load_picks_it_by_name():
    cpus = reference.cpus()
    assert len(cpus) == 2 and cpus[0] == "AMD EPYC" and "Xeon" in cpus[1]
    assert reference.load()["machine"]["cpu"] == "AMD EPYC"
    assert reference.load("amd")["machine"] == reference.load()["machine"]
    intel = reference.load("xeon")
    assert intel["machine"]["cpu"] == cpus[1] and intel["dtype"] == "float64"
    with pytest.raises(ValueError, match="no reference run on a CPU named like 'arm'.*AMD EPYC"):
        reference.load("arm")


def test_the_second_run_has_the_same_cases_with_their_quartiles():
    first, second = reference.load(), reference.load("xeon")

    def cases(rows, *keys):
        return {tuple(r[k] for k in keys) for r in rows}

    keys = ("impl", "mode", "n", "batch", "threads", "family", "busy")
    assert cases(second["rows"], *keys) == cases(first["rows"], *keys)
    one_keys = ("family", "dtype", "threads", "busy", "n")
    assert (cases(second["one_system"]["rows"], *one_keys)
            == cases(first["one_system"]["rows"], *one_keys))
    # the first run kept medians only; the second keeps each median's quartiles, around it
    assert all(r["quartiles"] is None for r in first["rows"])
    for r in second["rows"]:
        low, high = r["quartiles"]
        assert low <= r["seconds"] <= high
    for run in (first, second):  # both one-system runs keep quartiles
        for r in run["one_system"]["rows"]:
            for name in ("gtsv", "op"):
                low, high = r[f"{name}_quartiles"]
                assert low <= r[f"{name}_seconds"] <= high


def test_each_run_says_what_its_kernel_did_with_decaying_spikes_and_its_last_tile():
    """The one-system rows depend on both (chapter 15). The Intel's one-system run and its
    comparison with JAX timed a kernel that treats both as the installed one does; the AMD's
    one-system run cut its spikes but read its last tile one value at a time; the AMD's comparison
    with JAX did neither."""
    from tridiag_tutorial.kernels import compiled

    first, second = reference.load(), reference.load("xeon")
    assert second["one_system"]["machine"]["pieces_spikes"] == compiled.PIECES_SPIKES
    assert second["one_system"]["machine"]["pieces_last_tile"] == compiled.PIECES_LAST_TILE
    assert first["one_system"]["machine"]["pieces_spikes"] == compiled.PIECES_SPIKES
    old_spikes, old_tile = "computed to the end of each piece", "loaded one value at a time"
    assert (first["machine"]["pieces_spikes"], first["machine"]["pieces_last_tile"]) == (old_spikes, old_tile)
    assert (second["machine"]["pieces_spikes"], second["machine"]["pieces_last_tile"]) == (
        compiled.PIECES_SPIKES, compiled.PIECES_LAST_TILE)
    assert first["one_system"]["machine"]["pieces_last_tile"] == old_tile


@pytest.mark.skipif(not ACCURACY.exists(), reason="the accuracy results are not in this checkout")
def test_chapter_16s_accuracy_rows_are_both_variants_of_the_partitioned_kernel():
    raw = json.loads(ACCURACY.read_text())
    part = reference.load()["partitioned_accuracy"]
    assert part["machine"] == raw["machine"]
    for key, variant in (("before", "check only"), ("after", "refine + check")):
        rows = [r for r in part["rows"] if r["variant"] == variant]
        assert [r["ratios"] for r in rows] == [r.get("ratios") for r in raw["kernels"][key]["rows"]]
        assert sum(r["fallbacks"] for r in rows) == sum(
            r["fallbacks"] for r in raw["kernels"][key]["rows"])
