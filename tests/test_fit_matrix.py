"""What fits which GPU (`tiersep fit --gpus`, tiersep.memory.fit.matrix): the matrix agrees with
single `tiersep fit` calls cell by cell, a larger budget never needs more levers, the presets it
writes, and bad budget lists are one line (exit 2). Real CLI processes, real traces."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import on_a_terminal
from tiersep import config as C
from tiersep.memory.fit import matrix as fit_matrix
from tiersep.records import read_record

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
GIB = 2**30
# small fits 12 GiB as it is and needs checkpointing at 4; memory_optimized needs a shorter segment
# at both; nothing fits 0.5 GiB (the CUDA context alone is 0.76)
TIERS = ("small", "memory_optimized")
BUDGETS = ("0.5", "4", "12")
# one single `tiersep fit` per kind of answer: nothing fits, checkpointing, a shorter segment (the
# other cells: as is, and the same kinds again)
SINGLES = (("memory_optimized", "0.5"), ("small", "4"), ("memory_optimized", "12"))
COMMON = ["--config", "config/config.yaml", "--device", "cuda", "--calibration", "NVIDIA H100 80GB HBM3"]


def tiersep(*args: str) -> subprocess.Popen:
    return subprocess.Popen([TIERSEP, *args], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def finished(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def matrix_and_singles(tmp_path_factory):
    """The matrix of TIERS x BUDGETS (--json, --out) and the SINGLES, all started at once
    (separate processes: nothing is shared but the code)."""
    tmp = tmp_path_factory.mktemp("fit_matrix")
    procs = {"matrix": tiersep("fit", *COMMON, *[a for t in TIERS for a in ("--preset", t)],
                               "--gpus", ",".join(BUDGETS), "--json", str(tmp / "fit_matrix.json"),
                               "--out", str(tmp / "presets"))}
    for tier, budget in SINGLES:
        procs[(tier, budget)] = tiersep("fit", *COMMON, "--preset", tier, "--budget", budget,
                                        "--out", str(tmp / f"single_{tier}_{budget}.yaml"))
    results = {key: finished(proc) for key, proc in procs.items()}
    code, out, err = results.pop("matrix")
    assert code == 0, err[-3000:]
    return tmp, read_record("fit_matrix", tmp / "fit_matrix.json"), out, results


def printed_peak(out: str) -> float:
    """The trace estimate `tiersep fit` prints for what it wrote, in GiB."""
    return float(re.search(r"\(trace estimate (\d+\.\d+) GiB ±", out).group(1))


def test_the_matrix_agrees_with_single_fit_calls_cell_by_cell(matrix_and_singles):
    tmp, record, out, singles = matrix_and_singles
    assert [b["label"] for b in record["budgets"]] == ["0.5 GiB", "4 GiB", "12 GiB"]
    assert [row["tier"] for row in record["tiers"]] == list(TIERS)
    statuses = {(row["tier"], budget): cell["status"] for row in record["tiers"]
                for budget, cell in zip(BUDGETS, row["cells"])}
    for row in record["tiers"]:
        for budget, cell in zip(BUDGETS, row["cells"]):
            if (row["tier"], budget) not in singles:
                continue
            code, single_out, single_err = singles[(row["tier"], budget)]
            if cell["status"] == "no":   # fit exits 3 and names the same least budget
                assert code == 3, single_err
                assert f"which needs a budget of {cell['smallest_budget_bytes'] / GIB:.2f} GiB" in single_err
                assert cell["reason"].startswith(f"needs at least {cell['smallest_budget_bytes'] / GIB:.2f} GiB")
                continue
            assert code == 0, single_err
            single = yaml.safe_load((tmp / f"single_{row['tier']}_{budget}.yaml").read_text())
            written = yaml.safe_load((tmp / "presets" / f"{cell['preset']}.yaml").read_text())
            for section in ("audio", "model", "train"):   # the same levers, to the sample
                assert written[section] == single[section], (row["tier"], budget, section)
            changes = [line[4:] for line in single_out.splitlines() if line.startswith("  - ")]
            assert cell["changes"] == ([] if changes == ["nothing to change: it already fits"] else changes)
            peak = printed_peak(single_out)   # to the MiB (3 decimals of GiB)
            assert abs(cell["peak_bytes"] / GIB / peak - 1) <= 0.001, (row["tier"], budget, cell["peak_bytes"], peak)
    # the cells this test is about: every kind of answer is among them
    assert statuses == {("small", "0.5"): "no", ("small", "4"): "fitted", ("small", "12"): "as_is",
                        ("memory_optimized", "0.5"): "no", ("memory_optimized", "4"): "fitted",
                        ("memory_optimized", "12"): "fitted"}
    cut = record["tiers"][1]["cells"][2]
    assert cut["changes_input"] and "segment" in cut["levers"] and cut["short"].count("*") == 1
    assert 0.3 < cut["cost"]["extra_compute"] < 0.34 and cut["cost"]["segment_seconds_lost"] > 0
    assert "memory_optimized (as is" in out and "no (needs" in out   # the printed table


def test_a_larger_budget_never_needs_more_levers(matrix_and_singles):
    """Along each tier's row: no -> a variant -> as is, never back; the segment never shrinks and
    the levers never grow as the budget grows (small: no, checkpointing, as is; memory_optimized:
    no, then shorter segments that grow)."""
    _tmp, record, _out, _singles = matrix_and_singles
    rank = {"no": 0, "fitted": 1, "as_is": 2}
    for row in record["tiers"]:
        cells = row["cells"]
        for smaller, larger in zip(cells, cells[1:]):
            assert rank[larger["status"]] >= rank[smaller["status"]], row["tier"]
            if smaller["status"] != "no":
                assert len(larger["levers"]) <= len(smaller["levers"]), (row["tier"], smaller, larger)
                assert set(larger["levers"]) <= set(smaller["levers"]), (row["tier"], smaller, larger)
                assert larger["segment_seconds"] >= smaller["segment_seconds"], row["tier"]
    cuts = record["tiers"][1]["cells"][1:]
    assert cuts[0]["segment_seconds"] < cuts[1]["segment_seconds"]


def test_presets_are_written_per_cell_and_a_users_file_is_kept(matrix_and_singles, tmp_path):
    tmp, record, _out, _singles = matrix_and_singles
    names = sorted(p.name for p in (tmp / "presets").iterdir())
    expected = sorted(f"{c['preset']}.yaml" for row in record["tiers"] for c in row["cells"] if c["status"] != "no")
    assert names == expected and "small_fit_12gib.yaml" in names
    for name in names:   # every one is a valid preset named after its file
        assert C.load_preset(str(tmp / "presets" / name))["name"] == name[:-5]
    mine = tmp_path / "small_fit_12gib.yaml"
    mine.write_text("name: my own\n")
    presets = {("small", "12 GiB"): {"name": "small_fit_12gib", "description": "x"}}
    with pytest.raises(C.ConfigError, match="small_fit_12gib.yaml exists and is not a preset tiersep fit wrote"):
        fit_matrix.write_presets(tmp_path, presets)
    assert mine.read_text() == "name: my own\n"


BAD_LISTS = {
    "": "--gpus: no budget given",
    ",": "--gpus: ',' has an empty item",
    "8,-1.5": "--gpus: -1.5 is not a budget (a number of GiB > 0 and <= 4096, or a GPU name)",
    "RTX 9090": "--gpus: 'RTX 9090' is not a GPU of the catalogue (known: p100, v100-16gb,",
}


def test_a_bad_budget_list_is_one_line(tmp_path):
    """Empty, an empty item, negative, an unknown GPU: exit 2, one line naming --gpus, nothing
    written (all at once: each case is a process start)."""
    procs = {gpus: tiersep("fit", "--preset", "small", f"--gpus={gpus}", "--json", str(tmp_path / f"{i}.json"))
             for i, gpus in enumerate(BAD_LISTS)}
    for gpus, proc in procs.items():
        code, out, err = finished(proc)
        assert code == 2 and out == "", (gpus, err)
        assert err.count("\n") == 1 and err.startswith("tiersep fit: error: ") and BAD_LISTS[gpus] in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("item", ["-8", 0, "0", "nan", float("inf"), 4097, True, "8 GB"])
def test_what_is_not_a_budget(item):
    with pytest.raises(C.ConfigError, match=r"^--gpus: .* is not a (budget|GPU of the catalogue)"):
        fit_matrix.parse_budgets([item], "--gpus")


def test_budgets_from_the_config_name_the_file_and_key():
    cfg = C.load_config(REPO / "config" / "config.yaml")
    assert fit_matrix.gpus_argument(fit_matrix.config_budgets(cfg)) == "8,12,16,24,40,48,80,96"
    own = C.deep_merge(cfg, {"budget_gib": 10, "fit_matrix": {"gpus": [8, "h100"]}})
    budgets = fit_matrix.config_budgets(own)
    assert [b.label for b in budgets] == ["8 GiB", "H100 80GB HBM3", "10 GiB"]   # budget_gib joins
    assert fit_matrix.gpus_argument(budgets) == "8,h100,10"
    # issue 32: a small budget_gib keeps its own figure (bytes / GiB of 0.001 GiB read 0.000999999)
    tiny = fit_matrix.config_budgets(C.deep_merge(cfg, {"budget_gib": 0.001}))
    assert fit_matrix.gpus_argument(tiny).endswith(",0.001")
    assert fit_matrix.parse_budgets(["0.001"], "--gpus")[0].label == "0.001 GiB"
    bad = C.deep_merge(cfg, {"fit_matrix": {"gpus": ["A100"]}})
    with pytest.raises(C.ConfigError, match=r"config/config.yaml: fit_matrix.gpus: 'A100' is not a GPU"):
        fit_matrix.config_budgets(bad)
    with pytest.raises(C.ConfigError, match="a tier may not be named fit_matrix"):
        C.check_config(C.deep_merge(cfg, {"estimate_tiers": ["fit_matrix"]}))


def test_the_record_schema_wants_a_cell_per_budget(tmp_path):
    record = json.loads((REPO / "tests/fixtures/results/vram/fit_matrix.json").read_text())
    record["tiers"][0]["cells"].pop()
    path = tmp_path / "fit_matrix.json"
    path.write_text(json.dumps(record))
    with pytest.raises(C.ConfigError, match=r"fit_matrix.json: tiers/0/cells: 8 cells for 9 budgets"):
        read_record("fit_matrix", path)


def test_the_workflows_own_estimate_spares_the_first_trace():
    """`--estimates results/vram`: a record made alike is the search's first trace; one made for
    another calibration, micro-batch, method or device is not."""
    from tiersep.memory import estimate
    from tiersep.memory.fit import FitSearch, GateSettings

    preset = C.load_preset("small")
    record = estimate(preset, "trace", "cuda", 24 * GIB, 0.08, "NVIDIA H100 80GB HBM3")
    search = FitSearch(preset, "cuda", GateSettings(0.08, "NVIDIA H100 80GB HBM3"), estimate_record=record)
    assert search.reused == 1 and len(search.traces) == 1
    assert search.fit(12 * GIB).record["peak_bytes"] == record["peak_bytes"]
    for change in ({"batch_size": 2}, {"method": "analytic"}, {"device": "cpu"}, {"parameters": 1},
                   {"calibration": dict(record["calibration"], source="my.json")},
                   {"allocator": {"expandable_segments": False}}, {"torch": "2.10.0"}):
        assert not search.reusable({**record, **change}), change


def test_one_tier_searches_its_card_families_in_two_processes_with_one_processs_cells(tmp_path):
    """`--jobs 2` with one tier: its budgets by family (matrix.units: the preset their cards run the
    tier and its 16-bit lever as, on which calibration) in two processes. The T4 and P100 (fp16, the
    efficient kernel) are one family, the H100 and a 12 GiB budget on the H100's calibration another.
    The record and presets are one process's, cell for cell (a V100 32GB and an H100: one trace each)."""
    from tiersep.memory.fit import GateSettings

    preset, settings = C.load_preset("small"), GateSettings(0.08, "NVIDIA H100 80GB HBM3")
    budgets = fit_matrix.parse_budgets(["t4", "h100", "12", "p100"], "test")
    assert fit_matrix.units([("small", preset)], budgets, settings, split=True) == [(0, [0, 3]), (0, [1, 2])]
    assert fit_matrix.units([("small", preset)], budgets, settings, split=False) == [(0, [0, 1, 2, 3])]
    # ultra_safe's head dim 24 in bf16: flash on the RTX 3090, cuDNN attention on the H100 (torch tries
    # it first on Hopper): two families; the T4 runs fp16 on the efficient kernel
    cards = fit_matrix.parse_budgets(["rtx3090", "h100", "a100-40gb", "h200", "t4"], "test")
    assert fit_matrix.units([("ultra_safe", C.load_preset("ultra_safe"))], cards, settings, split=True) == [
        (0, [0, 2]), (0, [1, 3]), (0, [4])]
    records = {}
    for jobs in ("1", "2"):
        code, _out, err = finished(tiersep("fit", *COMMON, "--preset", "small", "--gpus", "v100-32gb,h100", "--jobs", jobs,
                                           "--json", str(tmp_path / f"m{jobs}.json"), "--out", str(tmp_path / jobs)))
        assert code == 0, err[-3000:]
        assert "fit --gpus" not in err        # not a terminal: no bar, the table on stdout is the output
        records[jobs] = {k: v for k, v in json.loads((tmp_path / f"m{jobs}.json").read_text()).items()
                         if k not in ("seconds", "traces")}
        records[jobs]["presets"] = {p.name: p.read_text() for p in sorted((tmp_path / jobs).iterdir())}
    assert records["2"] == records["1"]
    assert [(c["gpu"], c["precision"]) for c in records["2"]["tiers"][0]["cells"]] == [
        ("V100 32GB", "fp16"), ("H100 80GB HBM3", "bf16")]


def test_on_a_terminal_a_bar_counts_the_cells_as_the_parts_end(tmp_path):
    """stderr a terminal, `--jobs 2` and two families: tqdm's bar of the cells, drawn as each
    process's part ends; stdout still has the table."""
    proc, seen = on_a_terminal([TIERSEP, "fit", *COMMON, "--preset", "small", "--gpus", "v100-32gb,h100", "--jobs", "2"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, seen[-3000:]
    counts = [int(n) for n in re.findall(r"fit --gpus: +\d+%\|[^\r\n|]*\| (\d)/2 \[", seen.decode(errors="replace"))]
    assert counts[0] == 0 and 1 in counts and counts == sorted(counts), seen[-2000:]
    assert "V100 32GB" in out and "H100 80GB HBM3" in out
