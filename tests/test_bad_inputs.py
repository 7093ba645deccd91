"""One table of bad inputs and faults across every subcommand (issue 19), and the good cases beside
them. Each row runs the real `tiersep` (or `snakemake`) in its own process and asserts:

- the exit code the row documents;
- on a non-zero exit, a last stderr line `tiersep <command>: ...` naming the problem (the row's words);
- no "Traceback" anywhere in the output, and no line of a file the row feeds in echoed back;
- nothing outside the row's declared outputs changed (a snapshot of the row's folder and of the
  shared workspace before and after), and what the row keeps (`keep`) is byte for byte as it was.

The strict-value rows (NaN, integral floats, YAML bombs, CLI numbers) are tests/test_strict_inputs.py's
CASES, run here as part of this one table. test_table_counts prints how many rows there are, how
many were refused clearly and how many recovered. The stage tests (test_train_safety.py,
test_prepare_safety.py, test_report_safety.py, ...) check deeper properties of the same rules.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import test_strict_inputs as strict
from conftest import BIN, REPO, copy_workflow
from data_helpers import write_musdb_layout
from test_train_support import TINY_PRESET, cli_train

TIERSEP = str(BIN / "tiersep")
FIXTURE_RESULTS = REPO / "tests" / "fixtures" / "results"
FIXTURE_CONFIG = REPO / "tests" / "fixtures" / "report" / "config.yaml"
PRESET = TINY_PRESET["name"]
STEPS4 = ["--set", "train.steps=4", "--set", "train.schedule=constant", "--set", "train.warmup_steps=0",
          "--set", "train.checkpoint_every=2", "--set", "train.validate_every=2"]


@dataclass
class Row:
    id: str
    argv: list[str]                     # placeholders: {tmp} (the row's folder), {inputs}, {config}, {data}
    code: int
    says: list[str]                     # in the last stderr line (failure) or anywhere in the output (success)
    kind: str = "refused"               # refused | recovered | good | stopped
    setup: Callable[[Path, dict], None] | None = None
    outputs: tuple[str, ...] = ()       # paths under {tmp} the command may create or change
    keep: tuple[str, ...] = ()          # paths under {tmp} that must stay byte for byte
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None
    program: str = "tiersep"
    cwd: str = "repo"                   # repo, or a path under {tmp}
    env: dict = field(default_factory=dict)
    hold: str | None = None             # a folder under {tmp} whose one-writer lock another process holds
    signal_after_rows: tuple[int, int] | None = None   # (signal, metrics rows): a signal sent mid-run


# ---------------------------------------------------------------------------------------------
# Setups: each makes the row's inputs under its folder, from the shared workspace
# ---------------------------------------------------------------------------------------------
def users_folder(name: str):
    def setup(tmp: Path, ws: dict) -> None:
        (tmp / name / "src").mkdir(parents=True)
        (tmp / name / "src" / "thesis.tex").write_text("\\section{Results}\n")
    return setup


def musdb(tmp: Path, ws: dict, **data) -> None:
    """A small MUSDB18-HQ folder at {tmp}/musdb and {tmp}/musdb.yaml pointing at it."""
    info = write_musdb_layout(tmp / "musdb", sample_rate=16000, seconds=1.0)
    data = {"source": "musdb18hq", "root": str(tmp / "musdb"), "valid_tracks": info["valid_tracks"],
            "prepared_dir": str(tmp / "prepared_dir"), **data}
    (tmp / "musdb.yaml").write_text(json.dumps({"data": data, "tiers": ["cpu_tiny"], "estimate_tiers": []}))


def musdb_with(change: Callable[[Path], None], **data):
    def setup(tmp: Path, ws: dict) -> None:
        musdb(tmp, ws, **data)
        change(sorted((tmp / "musdb" / "train").iterdir())[0])
    return setup


def broken_link(track: Path) -> None:
    (track / "vocals.wav").unlink()
    (track / "vocals.wav").symlink_to(track / "gone.wav")


def looping_link(track: Path) -> None:
    (track / "vocals.wav").unlink()
    (track / "vocals.wav").symlink_to(track / "vocals.wav")


def silent_vocals(track: Path) -> None:
    import soundfile as sf

    audio, rate = sf.read(track / "vocals.wav", dtype="float32")
    sf.write(track / "vocals.wav", audio * 0, rate, subtype="FLOAT")


def finished_run(tmp: Path, ws: dict) -> None:
    shutil.copytree(ws["finished"], tmp / "run")


class Payload:
    """What a malicious .pt carries: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def payload_in(name: str):
    def setup(tmp: Path, ws: dict) -> None:
        finished_run(tmp, ws)
        path = tmp / "run" / name
        state = torch.load(path, weights_only=True)
        state["model"] = Payload(tmp / "PAYLOAD_RAN")
        torch.save(state, path)
        if name.endswith("last.prev.pt"):
            (tmp / "run" / "checkpoints" / "last.pt").write_bytes(b"damaged")
    return setup


def no_payload_ran(tmp: Path, proc) -> None:
    assert not (tmp / "PAYLOAD_RAN").exists(), "code ran from a checkpoint"
    assert not (tmp / "run" / "previous").exists(), "refused, not a quiet start-over"


def damaged(relative: str, content: bytes):
    def setup(tmp: Path, ws: dict) -> None:
        finished_run(tmp, ws)
        (tmp / relative).write_bytes(content)
    return setup


def stamped(name: str, stage: str):
    def setup(tmp: Path, ws: dict) -> None:
        from tiersep import outputs

        outputs.claim(tmp / name, stage)
    return setup


def results_copy(change: Callable[[Path], None] | None = None):
    def setup(tmp: Path, ws: dict) -> None:
        shutil.copytree(FIXTURE_RESULTS, tmp / "results")
        shutil.rmtree(tmp / "results" / "report", ignore_errors=True)
        if change:
            change(tmp / "results")
    return setup


def nan_score(results: Path) -> None:
    path = results / "eval" / "test_tiny" / "scores.json"
    scores = json.loads(path.read_text())
    scores["overall"]["si_sdr"] = float("nan")
    path.write_text(json.dumps(scores))


def html_names(results: Path) -> None:
    shutil.copytree(results / "train" / "test_tiny", results / "train" / "<script>alert(1)<")
    path = results / "eval" / "test_tiny" / "scores.json"
    path.write_text(path.read_text().replace('"Synthetic', '"<img src=x onerror=alert(2)> Synthetic'))


def binary_metrics(results: Path) -> None:
    (results / "train" / "test_tiny" / "metrics.csv").write_bytes(bytes(range(256)) * 4)


def workflow(change: Callable[[Path], None]):
    def setup(tmp: Path, ws: dict) -> None:
        wf = copy_workflow(tmp / "wf")
        change(wf)
    return setup


def corrupt_estimate(wf: Path) -> None:
    (wf / "results" / "vram").mkdir(parents=True)
    (wf / "results" / "vram" / "test_tiny.json").write_bytes(b"\x00{not json")
    (wf / "tiny.yaml").write_text((wf / "tests/configs/tiny.yaml").read_text())


def tier_as_path(wf: Path) -> None:
    text = (wf / "tests/configs/tiny.yaml").read_text()
    (wf / "tiny.yaml").write_text(text.replace("tiers: [test_tiny]", "tiers: [tests/configs/presets/test_tiny.yaml]"))


def wav_text(tmp: Path, ws: dict) -> None:
    (tmp / "song.wav").write_text("this is a text file, not audio\n")


def song(tmp: Path, ws: dict) -> None:
    import numpy as np
    import soundfile as sf

    t = np.arange(8000 * 2) / 8000
    sf.write(tmp / "song.wav", np.stack([np.sin(2 * np.pi * 440 * t)] * 2, axis=1) * 0.3, 8000)


def chain(*setups):
    def setup(tmp: Path, ws: dict) -> None:
        for one in setups:
            one(tmp, ws)
    return setup


# ---------------------------------------------------------------------------------------------
# Checks of what a successful row left
# ---------------------------------------------------------------------------------------------
def prepared(tmp: Path, proc) -> None:
    assert (tmp / "prepared" / "manifest.json").is_file()


def temp_removed(tmp: Path, proc) -> None:
    assert not (tmp / ".prepared.abcd1234.tmp").exists() and (tmp / "prepared" / "manifest.json").is_file()


def skipped_link(tmp: Path, proc) -> None:
    manifest = json.loads((tmp / "prepared" / "manifest.json").read_text())
    assert any("broken symlink" in s["reason"] for s in manifest["skipped"]), manifest["skipped"]


def silence_noted(tmp: Path, proc) -> None:
    manifest = json.loads((tmp / "prepared" / "manifest.json").read_text())
    assert any("vocals is silent" in note for note in manifest["notes"]), manifest["notes"]


def trained_longer(tmp: Path, proc) -> None:
    run = json.loads((tmp / "run" / "run.json").read_text())
    assert run["steps"] == 5 and run["extended_from"] == [{"steps": 4, "step": 4}]
    (kept,) = (tmp / "run" / "previous").iterdir()
    assert (kept / "model.pt").is_file()


def moved_aside(tmp: Path, proc) -> None:
    run = json.loads((tmp / "run" / "run.json").read_text())
    moved = Path(run["moved_aside"]["to"])
    assert (moved / "model.pt").is_file() and (moved / "checkpoints" / "last.pt").is_file()


def resumed(tmp: Path, proc) -> None:
    assert json.loads((tmp / "run" / "run.json").read_text())["steps"] == 5


def interrupted(tmp: Path, proc) -> None:
    from tiersep.train import checkpoint as ckpt

    assert ckpt.load_checkpoint(ckpt.last_path(tmp / "run"))["step"] >= 3
    assert not (tmp / "run" / "model.pt").exists()


def scored(tmp: Path, proc) -> None:
    assert json.loads((tmp / "eval" / "scores.json").read_text())["tracks"] == 1


def invalid_in_report(tmp: Path, proc) -> None:
    md = (tmp / "report" / "report.md").read_text()
    assert "invalid record" in md and "Every record could be read" not in md


def no_raw_html(tmp: Path, proc) -> None:
    for page in ("report.md", "index.html"):
        text = (tmp / "report" / page).read_text()
        assert "<script>alert" not in text and "<img src=x" not in text, page


def passwd_not_echoed(tmp: Path, proc) -> None:
    assert "root:" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def tiersep(command: str, *args: str) -> list[str]:
    return [command, "--config", "{config}", *args]


TRAIN = ("--preset", PRESET, "--data", "{data}")
EVAL = ("--preset", PRESET, "--data", "{data}")
SILENCE = {"TIERSEP_TEST_FREE_BYTES": str(3 * 2**20)}

NEW_ROWS = [
    # -- prepare: a user's folders, the source, the disk, killed runs, links, silence
    Row("prepare-out-is-a-users-project", tiersep("prepare", "--out", "{tmp}/myproject", "--sample-rate", "8000"), 2,
        ["myproject", "holds files tiersep did not make ('src')"], setup=users_folder("myproject"), keep=("myproject",)),
    Row("prepare-out-is-data-root", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/musdb"], 2,
        ["refused, it is data.root"], setup=musdb, keep=("musdb",)),
    Row("prepare-out-inside-data-root", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/musdb/p/8000"], 2,
        ["refused, it is inside data.root"], setup=musdb, keep=("musdb",)),
    Row("prepare-out-holds-data-root", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}"], 2,
        ["refused, it holds data.root"], setup=musdb, keep=("musdb",)),
    Row("prepare-out-is-the-working-directory", tiersep("prepare", "--out", ".", "--sample-rate", "8000"), 2,
        ["--out .: refused, it is the working directory"], setup=users_folder("work"), cwd="work/src", keep=("work",)),
    Row("prepare-out-is-root", tiersep("prepare", "--out", "/", "--sample-rate", "8000"), 2,
        ["--out /: refused, it is the root folder"]),
    Row("prepare-out-is-home", tiersep("prepare", "--out", "{tmp}/home", "--sample-rate", "8000"), 2,
        ["refused, it is your home folder"], setup=users_folder("home"), env={"HOME": "{tmp}/home"}, keep=("home",)),
    Row("prepare-out-in-use", tiersep("prepare", "--out", "{tmp}/prepared", "--sample-rate", "8000"), 5,
        ["--out", "prepared: in use by pid"], hold="prepared"),
    Row("prepare-disk-too-small", tiersep("prepare", "--out", "{tmp}/prepared", "--sample-rate", "8000"), 2,
        ["not enough free disk space"], env=SILENCE),
    Row("prepare-data-root-missing", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/p"], 2,
        ["data.root", "does not exist"], setup=lambda tmp, ws: (musdb(tmp, ws), shutil.rmtree(tmp / "musdb"))),
    Row("prepare-looping-symlink-stem", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/prepared"], 2,
        ["vocals.wav", "symlink loop"], setup=musdb_with(looping_link, skip_invalid=False), keep=("musdb",)),
    Row("prepare-broken-symlink-stem-skipped", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/prepared"],
        0, ["prepared"], kind="recovered", setup=musdb_with(broken_link, skip_invalid=True),
        outputs=("prepared",), keep=("musdb",), check=skipped_link),
    Row("prepare-silent-stem-noted", ["prepare", "--config", "{tmp}/musdb.yaml", "--out", "{tmp}/prepared"], 0,
        ["vocals is silent"], kind="recovered", setup=musdb_with(silent_vocals),
        outputs=("prepared",), keep=("musdb",), check=silence_noted),
    Row("prepare-cleans-a-killed-runs-temporary", tiersep("prepare", "--out", "{tmp}/prepared", "--sample-rate", "8000"),
        0, ["removed 1 temporary"], kind="recovered",
        setup=lambda tmp, ws: ((tmp / ".prepared.abcd1234.tmp").mkdir(),
                               (tmp / ".prepared.abcd1234.tmp" / "big.wav").write_bytes(b"\0" * 2**20)),
        outputs=("prepared", ".prepared.abcd1234.tmp"), check=temp_removed),
    Row("prepare-good", tiersep("prepare", "--out", "{tmp}/prepared", "--sample-rate", "8000"), 0, ["prepared 4 tracks"],
        kind="good", outputs=("prepared",), check=prepared),
    Row("prepare-again-does-nothing", tiersep("prepare", "--out", "{tmp}/prepared", "--sample-rate", "8000"), 0,
        ["nothing to do"], kind="good", setup=lambda tmp, ws: shutil.copytree(ws["data"], tmp / "prepared"),
        keep=("prepared",)),

    # -- train: a user's folder, two writers, code in checkpoints, changed presets, damage, signals
    Row("train-out-is-a-users-project", tiersep("train", *TRAIN, "--out", "{tmp}/myproject"), 2,
        ["myproject", "holds files tiersep did not make ('src')"], setup=users_folder("myproject"), keep=("myproject",)),
    Row("train-out-is-an-evaluate-folder", tiersep("train", *TRAIN, "--out", "{tmp}/ev"), 2,
        ["is a tiersep evaluate folder, not a train folder"], setup=stamped("ev", "evaluate"), keep=("ev",)),
    Row("train-out-in-use", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume"), 5,
        ["run: in use by pid"], setup=finished_run, hold="run", keep=("run",)),
    *[Row(f"train-pickle-payload-in-{name.split('/')[-1].replace('.', '-')}",
          tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume", *STEPS4), 2,
          [name.split("/")[-1], "refused", "posix.system", "could run code"], setup=payload_in(name),
          check=no_payload_ran,
          # a damaged last.pt is kept aside as last.corrupt.pt before last.prev.pt is tried
          outputs=("run/checkpoints/last.pt", "run/checkpoints/last.corrupt.pt", "run/failure.json"),
          keep=() if "prev" in name else ("run/model.pt", "run/checkpoints"))
      for name in ("checkpoints/last.pt", "checkpoints/best.pt", "checkpoints/last.prev.pt")],
    Row("train-longer-when-steps-grew", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume", *STEPS4[2:],
                                                  "--set", "train.steps=5"), 0,
        ["training longer", "continues from step 4"], kind="good", setup=finished_run, outputs=("run",),
        check=trained_longer),
    Row("train-changed-preset-moves-the-run-aside", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume", *STEPS4,
                                                             "--set", "train.lr=1e-3"), 0,
        ["differs in train.lr", "the earlier run is kept in"], kind="good", setup=finished_run, outputs=("run",),
        check=moved_aside),
    Row("train-truncated-last-falls-back", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume", *STEPS4[2:],
                                                    "--set", "train.steps=5"), 0,
        ["resumed from the previous checkpoint"], kind="recovered",
        setup=damaged("run/checkpoints/last.pt", b"PK\x03\x04 cut short"), outputs=("run",), check=resumed),
    Row("train-binary-metrics-on-resume", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume", *STEPS4[2:],
                                                   "--set", "train.steps=5"), 0,
        ["training longer"], kind="recovered", setup=damaged("run/metrics.csv", bytes(range(256)) * 8),
        outputs=("run",), check=resumed),
    Row("train-damaged-estimate-is-estimated-again", tiersep("train", *TRAIN, "--out", "{tmp}/run", *STEPS4,
                                                              "--estimate", "{tmp}/bad.json"), 0,
        ["not trusted, estimating again"], kind="recovered",
        setup=lambda tmp, ws: (tmp / "bad.json").write_bytes(b"\xff\xfe{garbage"), outputs=("run",)),
    Row("train-data-folder-missing", tiersep("train", *TRAIN[:2], "--data", "{tmp}/nothing", "--out", "{tmp}/run"), 2,
        ["nothing"], outputs=("run",)),
    Row("train-ctrl-c-checkpoints-and-stops", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume",
                                                       "--set", "train.steps=100000"), 130,
        ["interrupted at step", "run the same command to resume"], kind="stopped", outputs=("run",),
        signal_after_rows=(signal.SIGINT, 3), check=interrupted),
    Row("train-sigterm-checkpoints-and-stops", tiersep("train", *TRAIN, "--out", "{tmp}/run", "--resume",
                                                        "--set", "train.steps=100000"), 75,
        ["SIGTERM at step", "rerun with --resume"], kind="stopped", outputs=("run",),
        signal_after_rows=(signal.SIGTERM, 3), check=interrupted),

    # -- evaluate
    Row("evaluate-out-is-a-users-project", tiersep("evaluate", *EVAL, "--model", "{tmp}/run/model.pt", "--out",
                                                    "{tmp}/myproject"), 2,
        ["myproject", "holds files tiersep did not make ('src')"], setup=chain(users_folder("myproject"), finished_run),
        keep=("myproject",)),
    Row("evaluate-pickle-payload-in-model", tiersep("evaluate", *EVAL, "--model", "{tmp}/run/model.pt", "--out",
                                                     "{tmp}/eval"), 2,
        ["model.pt: refused", "posix.system"], setup=payload_in("model.pt"), check=no_payload_ran),
    Row("evaluate-truncated-model", tiersep("evaluate", *EVAL, "--model", "{tmp}/run/model.pt", "--out", "{tmp}/eval"), 2,
        ["model.pt: unreadable model file", "truncated or corrupt"], setup=damaged("run/model.pt", b"PK\x03\x04\x00")),
    Row("evaluate-model-missing", tiersep("evaluate", *EVAL, "--model", "{tmp}/none.pt", "--out", "{tmp}/eval"), 2,
        ["none.pt: model file not found"]),
    Row("evaluate-model-of-another-preset", tiersep("evaluate", *EVAL, "--set", "model.emb_dim=16", "--model",
                                                     "{tmp}/run/model.pt", "--out", "{tmp}/eval"), 2,
        ["trained with model.emb_dim = 8", "has 16"], setup=finished_run),
    Row("evaluate-out-in-use", tiersep("evaluate", *EVAL, "--model", "{tmp}/run/model.pt", "--out", "{tmp}/eval"), 5,
        ["eval: in use by pid"], setup=chain(finished_run, stamped("eval", "evaluate")), hold="eval", keep=("eval",)),
    Row("evaluate-good", tiersep("evaluate", *EVAL, "--model", "{tmp}/run/model.pt", "--out", "{tmp}/eval"), 0,
        ["overall"], kind="good", setup=finished_run, outputs=("eval",), check=scored),

    # -- report
    Row("report-out-is-a-users-project", ["report", "--config", str(FIXTURE_CONFIG), "--results", "{tmp}/results",
                                          "--out", "{tmp}/myproject"], 2,
        ["myproject", "holds files tiersep did not make ('src')"], setup=chain(users_folder("myproject"), results_copy()),
        keep=("myproject",)),
    Row("report-nan-score-is-an-invalid-record", ["report", "--config", str(FIXTURE_CONFIG), "--results",
                                                  "{tmp}/results", "--out", "{tmp}/report"], 0,
        ["wrote"], kind="recovered", setup=results_copy(nan_score), outputs=("report",), check=invalid_in_report),
    Row("report-html-in-names-is-escaped", ["report", "--config", str(FIXTURE_CONFIG), "--results", "{tmp}/results",
                                            "--out", "{tmp}/report"], 0,
        ["wrote"], kind="recovered", setup=results_copy(html_names), outputs=("report",), check=no_raw_html),
    Row("report-binary-metrics-is-an-invalid-record", ["report", "--config", str(FIXTURE_CONFIG), "--results",
                                                       "{tmp}/results", "--out", "{tmp}/report"], 0,
        ["wrote"], kind="recovered", setup=results_copy(binary_metrics), outputs=("report",), check=invalid_in_report),
    Row("report-out-in-use", ["report", "--config", str(FIXTURE_CONFIG), "--results", "{tmp}/results", "--out",
                              "{tmp}/report"], 5, ["report: in use by pid"],
        setup=chain(results_copy(), stamped("report", "report")), hold="report", keep=("report",)),
    Row("report-of-no-results-yet", ["report", "--config", str(FIXTURE_CONFIG), "--results", "{tmp}/none",
                                     "--out", "{tmp}/report"], 0, ["wrote"], kind="good", outputs=("report", "none")),

    # -- estimate, fit, config
    Row("estimate-unknown-preset", tiersep("estimate", "--preset", "no_such_tier", "--out", "{tmp}/e.json"), 2,
        ["preset 'no_such_tier' not found"]),
    Row("estimate-calibration-file-missing", tiersep("estimate", "--preset", PRESET, "--device", "cuda",
                                                      "--calibration", "{tmp}/gpu.json", "--out", "{tmp}/e.json"), 2,
        ["gpu.json"]),
    Row("estimate-set-unknown-field", tiersep("estimate", "--preset", PRESET, "--set", "train.speed=11", "--out",
                                               "{tmp}/e.json"), 2, ["train", "speed"]),
    Row("estimate-good", tiersep("estimate", "--preset", PRESET, "--method", "analytic", "--out", "{tmp}/e.json"), 0,
        ["wrote"], kind="good", outputs=("e.json",)),
    Row("fit-good", tiersep("fit", "--preset", PRESET, "--budget", "24", "--device", "cuda", "--out", "{tmp}/f.yaml"),
        0, ["wrote"], kind="good", outputs=("f.yaml",)),
    Row("config-unknown-key", ["estimate", "--config", "{tmp}/c.yaml", "--preset", "cpu_tiny", "--out", "{tmp}/e.json"],
        2, ["c.yaml", "unknown key 'budget'"], setup=lambda tmp, ws: (tmp / "c.yaml").write_text("budget: 24\n")),

    # -- separate
    Row("separate-out-is-a-users-project", ["separate", "--model", "{tmp}/run/model.pt", "{tmp}/song.wav", "--out",
                                            "{tmp}/myproject"], 2,
        ["myproject", "holds files tiersep did not make ('src')"],
        setup=chain(users_folder("myproject"), finished_run, song), keep=("myproject",)),
    Row("separate-text-file-named-wav", ["separate", "--model", "{tmp}/run/model.pt", "{tmp}/song.wav", "--out",
                                         "{tmp}/sep"], 2, ["song.wav"], setup=chain(finished_run, wav_text),
        outputs=("sep",)),
    Row("separate-pickle-payload-in-model", ["separate", "--model", "{tmp}/run/model.pt", "{tmp}/song.wav", "--out",
                                             "{tmp}/sep"], 2, ["model.pt: refused", "posix.system"],
        setup=chain(payload_in("model.pt"), song), check=no_payload_ran, outputs=("sep",)),

    # -- snakemake: the DAG over damaged records and tiers given as files
    Row("snakemake-plan-over-a-corrupt-estimate", ["-n", "--configfile", "tiny.yaml"], 0, ["This was a dry-run"],
        kind="recovered", program="snakemake", cwd="wf", setup=workflow(corrupt_estimate), outputs=("wf",)),
    Row("snakemake-tier-given-as-a-preset-file", ["-n", "--configfile", "tiny.yaml"], 0,
        ["results/train/test_tiny/outcome.json"], kind="good", program="snakemake", cwd="wf",
        setup=workflow(tier_as_path), outputs=("wf",)),
]

STRICT_ROWS = [
    Row(case_id, [a.replace("{tmp}", "{inputs}") for a in argv], code, expected,
        check=passwd_not_echoed if "passwd" in " ".join(argv) else None)
    for case_id, argv, code, expected in strict.CASES
]
ROWS = STRICT_ROWS + NEW_ROWS


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The shared workspace: a config, a prepared tiny set, a finished 4-step run of the tiny preset,
    and the strict rows' input files. Rows copy what they change."""
    from test_train_support import make_workspace

    space = make_workspace(tmp_path_factory.mktemp("table"))
    space["finished"] = space["root"] / "finished"
    proc = cli_train(space, space["finished"], *STEPS4)
    assert proc.wait(timeout=300) == 0, Path(str(space["finished"]) + ".log").read_text()[-2000:]
    inputs = space["root"] / "inputs"
    inputs.mkdir()
    for name, text in strict.FILES.items():
        (inputs / name).write_text(text)
    for name, data in strict.BINARY.items():
        (inputs / name).write_bytes(data)
    (inputs / "folder.yaml").mkdir()
    space["inputs"] = inputs
    return space


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 (files) or 'dir' / 'link' of everything under `folder`."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def declared(key: str, row: Row) -> bool:
    """Whether a path (relative to the row's folder) is one the row may create or change: its
    outputs, and the one-writer lock file beside its --out folder (tiersep's own, made before the
    checks that may refuse)."""
    out = next((Path(v).name for k, v in zip(row.argv, row.argv[1:]) if k == "--out"), None)
    locks = {f".{Path(o).name}.lock" for o in (*row.outputs, *([row.hold] if row.hold else []), *([out] if out else []))}
    return any(key == o or key.startswith(o + "/") for o in row.outputs) or Path(key).name in locks


HOLD = """
import sys, time
from tiersep import outputs
with outputs.exclusive(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def run_row(row: Row, tmp: Path, ws: dict) -> subprocess.CompletedProcess:
    fill = {"{tmp}": str(tmp), "{inputs}": str(ws["inputs"]), "{config}": str(ws["config_file"]),
            "{data}": str(ws["data"])}

    def fill_in(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    argv = [fill_in(a) for a in row.argv]
    cwd = REPO if row.cwd == "repo" else tmp / row.cwd
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           **{k: fill_in(v) for k, v in row.env.items()}}
    program = TIERSEP if row.program == "tiersep" else str(BIN / "snakemake")
    holder = None
    if row.hold:
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp / row.hold)], stdout=subprocess.PIPE,
                                  text=True, cwd=REPO)
        assert holder.stdout.readline().strip() == "held"
    try:
        if row.signal_after_rows is None:
            return subprocess.run([program, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        sig, rows = row.signal_after_rows
        proc = subprocess.Popen([program, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        metrics = tmp / "run" / "metrics.csv"
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) > rows:
                break
            time.sleep(0.01)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_row(row: Row, ws, tmp_path):
    if row.id == "estimate-measure-cuda-without-gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: measure on cuda is a valid request here")
    tmp = tmp_path / "row"
    tmp.mkdir()
    if row.setup:
        row.setup(tmp, ws)
    shared_before = snapshot(ws["root"])
    before = snapshot(tmp)
    started = time.monotonic()
    proc = run_row(row, tmp, ws)
    seconds = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-4000:]
    assert proc.returncode == row.code, output[-4000:]
    if row.code != 0:
        last = proc.stderr.strip().splitlines()[-1]
        command = row.argv[0] if row.program == "tiersep" else None
        assert command is None or last.startswith(f"tiersep {command}: "), last
        for words in row.says:
            assert words in last, f"{words!r} not in the last line: {last}"
    else:
        for words in row.says:
            assert words in output, f"{words!r} not in the output:\n{output[-3000:]}"
    assert strict.SECRET not in output                       # a file's content is not echoed
    if "alias" in row.id:
        assert seconds < 5, f"the alias bomb took {seconds:.1f} s"

    after = snapshot(tmp)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k) and not declared(k, row))
    assert not changed, f"changed outside the row's outputs: {changed[:10]}"
    for kept in row.keep:
        assert {k: v for k, v in after.items() if k == kept or k.startswith(kept + "/")} == \
               {k: v for k, v in before.items() if k == kept or k.startswith(kept + "/")}, f"{kept} changed"
    assert snapshot(ws["root"]) == shared_before, "the shared workspace changed"
    if row.check:
        row.check(tmp, proc)


def test_table_counts():
    """The table's size, as the issue's closing note gives it (at least 60 bad inputs and faults)."""
    kinds = {kind: sum(row.kind == kind for row in ROWS) for kind in ("refused", "recovered", "stopped", "good")}
    print(f"\n{len(ROWS)} rows: {kinds['refused']} refused clearly (one line, exit 2/3/5), "
          f"{kinds['recovered']} recovered, {kinds['stopped']} stopped cleanly by a signal, {kinds['good']} good")
    assert kinds["refused"] + kinds["recovered"] + kinds["stopped"] >= 60
    assert len({row.id for row in ROWS}) == len(ROWS)
