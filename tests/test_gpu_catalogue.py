"""The GPU catalogue (tiersep.gpu_catalogue): every entry complete and consistent with the kernel
ranges of torch's sdp_utils.cpp, NVML names mapped through gpu_info (its TIERSEP_FAKE_GPUS seam:
there is no GPU here), an unknown card's conservative fallback, `tiersep fit --gpus t4,h100`
through the real CLI, and docs/memory.md's table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiersep import gpu_catalogue, gpu_info
from tiersep.memory import calibration

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
GIB = 2**30
# the issue's list, by short name
REQUIRED = {"p100", "v100-16gb", "v100-32gb", "t4", "rtx2080ti", "rtx3060", "rtx3060-8gb", "rtx3090", "rtx4060ti-8gb",
            "rtx4060ti-16gb", "rtx4090", "a10", "a100-40gb", "a100-80gb", "l4", "l40s", "h100", "h200", "b200"}
# what each generation runs, written out (not derived): sdp_utils.cpp's flash and cuDNN sm80-sm121,
# memory-efficient sm50-sm121
PRE_AMPERE = ("efficient", "math")
AMPERE_ON = ("flash", "efficient", "cudnn", "math")


def test_the_catalogue_covers_the_issues_gpus_with_complete_entries():
    entries = gpu_catalogue.CATALOGUE
    names = [e.name for e in entries]
    assert len(set(names)) == len(names) and REQUIRED <= set(names)
    for e in entries:
        assert e.model and e.aliases and all(e.aliases), e.name
        assert e.memory_bytes > 0 and (e.memory_source == "nominal" or e.memory_source.startswith("measured: "))
        assert e.note is None, e.name
    models = [e.model.lower() for e in entries]
    assert len(set(models)) == len(models)


@pytest.mark.parametrize("entry", gpu_catalogue.CATALOGUE, ids=lambda e: e.name)
def test_bf16_and_kernels_follow_the_compute_capability(entry):
    """bf16 iff sm80+; the kernels as the sm ranges of sdp_utils.cpp give them, and the ranges as read."""
    assert entry.bf16 == (entry.capability >= (8, 0))
    assert entry.kernels == (AMPERE_ON if entry.capability >= (8, 0) else PRE_AMPERE)
    assert entry.kernels == gpu_catalogue.kernels_for(entry.capability)
    assert (gpu_catalogue.FLASH_SM, gpu_catalogue.EFFICIENT_SM, gpu_catalogue.CUDNN_SM) == \
        (((8, 0), (12, 1)), ((5, 0), (12, 1)), ((8, 0), (12, 1)))


def test_the_generations_the_issue_names():
    g = gpu_catalogue.by_name()
    for name, sm in {"p100": (6, 0), "v100-16gb": (7, 0), "t4": (7, 5), "rtx2080ti": (7, 5), "a100-40gb": (8, 0),
                     "rtx3090": (8, 6), "l4": (8, 9), "h100": (9, 0), "b200": (10, 0)}.items():
        assert g[name].capability == sm, name
    assert not g["t4"].bf16 and "flash" not in g["t4"].kernels
    # the measured totals: the H100's built-in calibration and the H200's shared measurement
    h100 = json.loads(calibration.builtin()["NVIDIA H100 80GB HBM3"].read_text())
    assert g["h100"].memory_bytes == h100["total_memory_bytes"]
    h200 = json.loads((REPO / "tests/data/gpu/h200-2026-11-26/calibration.json").read_text())
    assert g["h200"].memory_bytes == h200["total_memory_bytes"] and g["t4"].memory_bytes == 16 * 10**9
    # a nominal size is read as 10^9 bytes because that is below what a card reports: so it is on the
    # one card measured here (sold as 80 GB), where 80 GiB would have been above
    assert 80 * 10**9 < h100["total_memory_bytes"] < 80 * GIB


def fake_machine(monkeypatch, *cards: dict) -> None:
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, json.dumps(list(cards)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("entry", gpu_catalogue.CATALOGUE, ids=lambda e: e.name)
def test_every_nvml_name_maps_to_its_entry(monkeypatch, entry):
    for alias in entry.aliases:
        fake_machine(monkeypatch, {"name": alias, "total": entry.memory_bytes - 300 * 2**20})
        assert gpu_info.catalogue_entry() == entry, alias


def test_cards_that_share_a_name_are_told_apart_by_memory(monkeypatch):
    fake_machine(monkeypatch, {"name": "NVIDIA GeForce RTX 4060 Ti", "total": 17_175_674_880},
                 {"name": "NVIDIA GeForce RTX 4060 Ti", "total": 8_585_740_288})
    assert [gpu_info.catalogue_entry(i).name for i in (0, 1)] == ["rtx4060ti-16gb", "rtx4060ti-8gb"]
    assert gpu_catalogue.catalogue_entry("NVIDIA GeForce RTX 4060 Ti").name == "rtx4060ti-8gb"   # the smaller
    fake_machine(monkeypatch, {"name": "NVIDIA GeForce RTX 3060", "total": 12_884_901_888 - 300 * 2**20})
    assert gpu_info.catalogue_entry().name == "rtx3060"


def test_an_unknown_card_falls_back_conservatively_with_a_note(monkeypatch):
    fake_machine(monkeypatch, {"name": "NVIDIA RTX PRO 9000", "total": 100 * GIB})
    entry = gpu_info.catalogue_entry()
    assert entry.name == "unknown" and not entry.bf16 and entry.kernels == PRE_AMPERE
    assert entry.memory_bytes == 100 * GIB
    assert entry.note.startswith("'NVIDIA RTX PRO 9000' is not in the GPU catalogue") and "no native bf16" in entry.note
    monkeypatch.setenv(gpu_info.FAKE_GPUS_ENV, "[]")   # no GPU at all
    assert gpu_info.catalogue_entry().note.startswith("'no GPU name' is not in the GPU catalogue")


def test_fit_by_gpu_model_through_the_cli(tmp_path):
    """Columns headed with the model and its size; the record names the catalogue entry."""
    done = subprocess.run([TIERSEP, "fit", "--config", "config/config.yaml", "--preset", "cpu_tiny",
                           "--gpus", "t4,h100", "--json", str(tmp_path / "m.json")],
                          cwd=REPO, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.strip().startswith("T4 (14.9 GiB) ") for line in lines), done.stdout
    assert any(line.strip().startswith("H100 80GB HBM3 (79.2 GiB) ") for line in lines), done.stdout
    record = json.loads((tmp_path / "m.json").read_text())
    assert [(b["label"], b["gpu"]) for b in record["budgets"]] == [("T4", "t4"), ("H100 80GB HBM3", "h100")]


def test_the_docs_table_is_the_catalogue():
    text = (REPO / "docs" / "memory.md").read_text()
    table = "\n".join(gpu_catalogue.table_markdown())
    assert table in text, "docs/memory.md: the GPU table is out of date; paste gpu_catalogue.table_markdown()"
    assert text.count("| name | model | NVML names |") == 1
