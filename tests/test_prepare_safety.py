"""`tiersep prepare --out` replaces only what tiersep made (issue 19), through the real CLI in real
processes: a user's folder, the source dataset, `.`, `/` and home are refused with one line and
left byte-identical; a killed prepare's temporaries are removed by the next one; two prepares of
one folder cannot both write; the disk is checked first; silence is noted; broken symlinks in a
source are invalid tracks, not tracebacks."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml

from data_helpers import write_musdb_layout
from tiersep.data.ingest import SourceTrack
from tiersep.data.prepare import FREE_BYTES_ENV, MANIFEST, estimate_bytes

REPO = Path(__file__).resolve().parents[1]
# 3 s tracks at 16 kHz, prepared at 8 kHz: a few seconds a run
SYNTH = {"seed": 1, "sample_rate": 16000, "train_tracks": 3, "valid_tracks": 1, "test_tracks": 1,
         "track_seconds": 3}


def write_config(folder: Path, data: dict | None = None, **synth) -> Path:
    data = {"prepared_dir": str(folder / "data" / "prepared"), "synthetic": {**SYNTH, **synth}, **(data or {})}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({"data": data, "presets_dir": str(REPO / "config" / "presets")}))
    return path


def command(config: Path, out, rate: int = 8000) -> list[str]:
    return [sys.executable, "-m", "tiersep.cli", "prepare", "--config", str(config), "--out", str(out),
            "--sample-rate", str(rate)]


# Root reads any folder through two capabilities; without them (CI runs as root) a mode-0 folder it
# owns is as unreadable to it as to a user. setpriv drops them from the bounding set, so the command
# it starts never holds them.
WITHOUT_DAC = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])


def prepare(config: Path, out, cwd: Path, rate: int = 8000, env: dict | None = None,
            prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *command(config, out, rate)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def refused(proc: subprocess.CompletedProcess, pattern: str, code: int = 2) -> None:
    """Exit `code`, the last stderr line matches `pattern`, no traceback anywhere."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(pattern, last), last


def snapshot(folder: Path) -> dict:
    """Every entry under `folder` (itself included): its content hash (files), link target, mtime."""
    state = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        st = path.lstat()
        if path.is_symlink():
            kind = "-> " + os.readlink(path)
        elif path.is_file():
            kind = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            kind = "dir"
        state[str(path.relative_to(folder))] = (kind, st.st_mtime_ns)
    return state


def temps(folder: Path, owner: str) -> list[Path]:
    return sorted(folder.glob(f".{owner}.*.tmp"))


def wait_for(proc: subprocess.Popen, found, what: str, timeout: float = 120.0):
    """Poll until found() is truthy while `proc` runs; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = found()
        if hit:
            return hit
        if proc.poll() is not None:
            raise AssertionError(f"prepare ended ({proc.returncode}) before {what}")
        time.sleep(0.002)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout} s")


# ----------------------------------------------------------------------------- a user's folders
@pytest.fixture(scope="module")
def musdb_root(tmp_path_factory):
    """A small MUSDB18-HQ-layout folder (3 train tracks, 1 test, 1 s at 16 kHz) and its config."""
    base = tmp_path_factory.mktemp("user")
    root = base / "musdb18hq"
    info = write_musdb_layout(root, sample_rate=16000, seconds=1.0)
    config = write_config(base, {"source": "musdb18hq", "root": str(root), "valid_tracks": info["valid_tracks"]})
    return base, root, config


def test_users_folder_survives(tmp_path):
    config = write_config(tmp_path)
    project = tmp_path / "myproject"
    (project / "src").mkdir(parents=True)
    (project / "src" / "thesis.tex").write_text("\\documentclass{article}\n")
    os.utime(project / "src" / "thesis.tex", ns=(1_000_000_000, 1_000_000_000))
    before, around = snapshot(project), sorted(os.listdir(tmp_path))
    proc = prepare(config, project, tmp_path)
    refused(proc, r"--out \S*myproject: holds files tiersep did not make \('src'\); .*give a new or empty folder$")
    assert snapshot(project) == before
    assert (project / "src" / "thesis.tex").read_text() == "\\documentclass{article}\n"
    assert sorted(os.listdir(tmp_path)) == around  # refused before anything: no lock, no source made


@pytest.mark.parametrize("content, pattern", [
    ({"manifest.json": '{"name": "my web app", "icons": []}'},
     r"holds files tiersep did not make \('manifest.json'; its manifest.json is not a tiersep manifest: "),
    ({"manifest.json": "\x00\x01binary"}, r"\('manifest.json'; its manifest.json is not a tiersep manifest"),
    ({"notes.txt": "mine"}, r"holds files tiersep did not make \('notes.txt'\)"),
])
def test_look_alike_or_added_to_prepared_set_is_refused(tmp_path, content, pattern):
    """Only a valid tiersep manifest makes a folder tiersep's, and a prepared set the user added a
    file to is no longer only tiersep's."""
    config = write_config(tmp_path)
    out = tmp_path / "out"
    if "notes.txt" in content:
        assert prepare(config, out, tmp_path, rate=16000).returncode == 0  # equal rate: a quick copy
        shutil.rmtree(out / "test")  # damaged too: a rebuild would be due
    else:
        out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    before = snapshot(out)
    refused(prepare(config, out, tmp_path), pattern)
    assert snapshot(out) == before


@pytest.mark.parametrize("where", ["root", "inside", "holds", "link to root", "root's train"])
def test_source_dataset_is_never_the_output(musdb_root, tmp_path, where):
    base, root, config = musdb_root
    out = {"root": root, "inside": root / "prepared" / "8000", "holds": base, "root's train": root / "train",
           "link to root": tmp_path / "link"}[where]
    if where == "link to root":
        out.symlink_to(root)
    before = snapshot(root)
    proc = prepare(config, out, tmp_path)
    what = {"root": "it is", "link to root": "it is", "inside": "it is inside", "root's train": "it is inside",
            "holds": "it holds"}[where]
    refused(proc, rf"--out \S+: refused, {what} data.root \(\S*musdb18hq\)")
    assert snapshot(root) == before
    assert not (root / "prepared").exists()


@pytest.mark.parametrize("out, pattern", [
    (".", r"--out \.: refused, it is the working directory"),
    ("..", r"--out \.\.: refused, it holds the working directory"),
    ("/", r"--out /: refused, it is the root folder"),
    ("HOME", r"--out \S+/home: refused, it is your home folder"),
])
def test_cwd_root_and_home_are_refused(tmp_path, out, pattern):
    config = write_config(tmp_path)
    cwd, home = tmp_path / "w" / "work", tmp_path / "h" / "home"
    for folder in (cwd, home):
        (folder / "keep").mkdir(parents=True)
        (folder / "keep" / "file.txt").write_text("mine")
    before = {f: snapshot(f) for f in (cwd, home)}
    proc = prepare(config, home if out == "HOME" else out, cwd, env={"HOME": str(home)})
    refused(proc, pattern)
    assert {f: snapshot(f) for f in (cwd, home)} == before


def test_data_root_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "musdb.zip").write_bytes(b"PK\x03\x04")
    config = write_config(tmp_path, {"source": "musdb18hq", "root": str(tmp_path / "musdb.zip")})
    refused(prepare(config, tmp_path / "out", tmp_path), r"data.root: \S*musdb.zip does not exist or is not a folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, pattern", [
    ("out under a file", r"--out \S*a-file/out: cannot be made, \S*a-file is a file$"),
    ("out is a file", r"--out \S*a-file: is a file, not a folder$"),
    ("prepared_dir under a file", r"data.prepared_dir: cannot write the synthetic set to \S*a-file/raw "
                                  r"\(\S*a-file/raw: Not a directory\)$"),
    ("manifest is a list", r"\('manifest.json'; its manifest.json is not a tiersep manifest: \S*: expected a "
                           r"JSON object, got list\)"),
    ("synthetic folder is the user's", r"synthetic-\w+: holds files tiersep did not make \('mine.txt'; no "
                                       r"tiersep_synthetic.json\); tiersep never removes them"),
])
def test_other_bad_outputs_are_one_line(tmp_path, case, pattern):
    (tmp_path / "a-file").write_text("mine")
    config = write_config(tmp_path, {"prepared_dir": str(tmp_path / "a-file" / "prepared")}
                          if case == "prepared_dir under a file" else None)
    out = {"out under a file": tmp_path / "a-file" / "out", "out is a file": tmp_path / "a-file"}.get(case, tmp_path / "out")
    if case == "manifest is a list":
        out.mkdir()
        (out / MANIFEST).write_text("[1, 2]")
    if case == "synthetic folder is the user's":
        from tiersep import config as C
        from tiersep.data.synthetic import synthetic_root

        users = synthetic_root(C.load_config(config))
        users.mkdir(parents=True)
        (users / "mine.txt").write_text("mine")
    refused(prepare(config, out, tmp_path), pattern)
    assert (tmp_path / "a-file").read_text() == "mine"
    if case == "synthetic folder is the user's":
        assert os.listdir(users) == ["mine.txt"]


# ----------------------------------------------------------------------------- tiersep's own folders
def test_earlier_set_is_rebuilt_empty_folder_used_and_only_stale_temps_removed(tmp_path):
    config = write_config(tmp_path)
    out, empty = tmp_path / "prepared" / "8000", tmp_path / "empty"
    assert prepare(config, out, tmp_path, rate=16000).returncode == 0  # the same folder, other settings
    stale = out.parent / ".8000.abcd1234.tmp"
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "half.wav").write_bytes(b"\0" * 1000)
    not_ours = [out.parent / n for n in (".8000.ABCD1234.tmp", ".8000.abc.tmp", "8000.abcd1234.tmp",
                                         ".other.abcd1234.tmp", ".8000.abcd1234.tmp.keep")]
    for path in not_ours:
        path.mkdir()
    proc = prepare(config, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rebuilding (prepared for other settings (sample_rate changed))" in proc.stdout
    assert "removed 1 temporary file(s) a killed job left" in proc.stderr
    assert json.loads((out / MANIFEST).read_text())["sample_rate"] == 8000
    assert not stale.exists() and all(p.is_dir() for p in not_ours)

    empty.mkdir()
    proc = prepare(config, empty, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in empty.iterdir()) == [MANIFEST, "test", "train", "valid"]


def test_killed_prepares_leave_nothing_behind(tmp_path):
    """SIGKILL while generating the synthetic source, then while writing the prepared folder: each
    next run removes the temporary the killed one left, and the last one completes."""
    config = write_config(tmp_path, seed=5, train_tracks=6)  # a longer generation to catch
    raw, out = tmp_path / "data" / "raw", tmp_path / "prepared" / "8000"
    logs = []
    for folder, owner in ((raw, "synthetic-*"), (out.parent, "8000")):
        logs.append(tmp_path / f"kill{len(logs)}.log")
        with open(logs[-1], "w") as log:
            proc = subprocess.Popen(command(config, out), cwd=tmp_path, stdout=log, stderr=log)
            wait_for(proc, lambda: temps(folder, owner), f"a temporary {folder}/.{owner}.*.tmp")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert temps(folder, owner), "the kill came too late to leave a temporary"
    proc = prepare(config, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"removed 1 temporary file(s) a killed job left in {raw}" in logs[1].read_text()
    assert f"removed 1 temporary file(s) a killed job left in {out}" in proc.stderr
    assert not temps(raw, "synthetic-*") and not temps(out.parent, "8000")
    assert json.loads((out / MANIFEST).read_text())["sample_rate"] == 8000


def test_second_prepare_of_one_folder_stops_at_once(tmp_path):
    config = write_config(tmp_path)
    out = tmp_path / "out"
    assert prepare(config, tmp_path / "at16k", tmp_path, rate=16000).returncode == 0  # the source exists
    first = subprocess.Popen(command(config, out), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_for(first, lambda: temps(tmp_path, "out"), "the first prepare's temporary folder")
        first.send_signal(signal.SIGSTOP)  # holds the lock, mid-build, for as long as we need
        second = prepare(config, out, tmp_path)
        refused(second, rf"--out \S*out: in use by pid {first.pid} on \S+ .*wait for it to finish", code=5)
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert "prepared 4 tracks" in stdout
    assert json.loads((out / MANIFEST).read_text())["sample_rate"] == 8000 and not temps(tmp_path, "out")


# ----------------------------------------------------------------------------- disk, silence, symlinks
def test_disk_space_is_checked_first(tmp_path):
    config = write_config(tmp_path)
    out = tmp_path / "out"
    proc = prepare(config, out, tmp_path, env={FREE_BYTES_ENV: str(3 * 2**20)})
    refused(proc, rf"--out \S*out: not enough free disk space: the prepared set needs about 3\.8 MiB "
                  rf"\(\+ 16\.0 MiB margin\) but {re.escape(str(tmp_path))} has 3\.0 MiB free")
    assert not out.exists() and not temps(tmp_path, "out")
    # the estimate is the real size, a little over
    proc = prepare(config, out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    real = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    manifest = json.loads((out / MANIFEST).read_text())
    tracks = [SourceTrack(t["name"], t["subset"], t["split"], True, Path(), t["source_rate"], t["source_samples"])
              for t in manifest["tracks"]]
    assert real <= estimate_bytes(tracks, 8000) <= real * 1.05 + 2**17


def test_silent_mixture_and_stem_are_noted(tmp_path, musdb_root):
    _base, pristine, _config = musdb_root
    root = tmp_path / "musdb18hq"
    shutil.copytree(pristine, root)
    tracks = sorted((root / "train").iterdir())
    no_vocals, silent = tracks[0], root / "test" / next((root / "test").iterdir()).name
    rate = sf.info(str(no_vocals / "vocals.wav")).samplerate
    sf.write(str(no_vocals / "vocals.wav"), np.zeros((rate, 2), np.float32), rate, subtype="FLOAT")
    for wav in silent.glob("*.wav"):
        sf.write(str(wav), np.zeros((rate, 2), np.float32), rate, subtype="FLOAT")
    config = write_config(tmp_path, {"source": "musdb18hq", "root": str(root), "valid_tracks": [tracks[-1].name]})
    proc = prepare(config, tmp_path / "out", tmp_path, rate=rate)
    assert proc.returncode == 0, proc.stderr
    notes = json.loads((tmp_path / "out" / MANIFEST).read_text())["notes"]
    assert f"train/{no_vocals.name}: vocals is silent (all zeros)" in notes
    assert f"test/{silent.name}: mixture is silent (all zeros)" in notes
    assert len(notes) == 1 + 5 and not any(no_vocals.name in n and "vocals" not in n for n in notes)
    assert f"warning: train/{no_vocals.name}: vocals is silent (all zeros)" in proc.stderr
    assert re.search(rf"WARNING: test/{re.escape(silent.name)}: mixture is silent \(all zeros\); this track "
                     r"cannot teach the model anything", proc.stderr)
    assert "6 note(s) in manifest.json" in proc.stdout


@pytest.mark.parametrize("skip_invalid", [True, False])
def test_broken_and_looping_symlink_stems(tmp_path, musdb_root, skip_invalid):
    _base, pristine, _config = musdb_root
    root = tmp_path / "musdb18hq"
    shutil.copytree(pristine, root)
    extra = [root / "train" / "Zz Extra - Broken", root / "train" / "Zz Extra - Loop"]
    for folder in extra:
        shutil.copytree(next(p for p in (root / "train").iterdir() if p not in extra), folder)
    (extra[0] / "vocals.wav").unlink()
    (extra[0] / "vocals.wav").symlink_to(tmp_path / "gone.wav")
    (extra[1] / "bass.wav").unlink()
    (extra[1] / "bass.wav").symlink_to("bass.wav")  # itself: ELOOP
    valid = sorted(p.name for p in (root / "train").iterdir() if p not in extra)[-1:]
    config = write_config(tmp_path, {"source": "musdb18hq", "root": str(root), "valid_tracks": valid,
                                     "skip_invalid": skip_invalid})
    proc = prepare(config, tmp_path / "out", tmp_path, rate=16000)
    if not skip_invalid:
        refused(proc, r"musdb18hq: track 'Zz Extra - Broken': stem file \S*/Zz Extra - Broken/vocals\.wav is a "
                      r"broken symlink \(to \S*gone\.wav: No such file or directory\)$")
        assert not (tmp_path / "out").exists()
        return
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    skipped = {s["name"]: s["reason"] for s in json.loads((tmp_path / "out" / MANIFEST).read_text())["skipped"]}
    assert set(skipped) == {"Zz Extra - Broken", "Zz Extra - Loop"}
    assert "vocals.wav is a broken symlink" in skipped["Zz Extra - Broken"]
    assert "bass.wav is a symlink loop" in skipped["Zz Extra - Loop"]


@pytest.mark.parametrize("skip_invalid", [True, False])
def test_unreadable_track_folder(tmp_path, musdb_root, skip_invalid):
    _base, pristine, _config = musdb_root
    root = tmp_path / "musdb18hq"
    shutil.copytree(pristine, root)
    locked = sorted((root / "train").iterdir())[0]
    valid = [sorted((root / "train").iterdir())[-1].name]
    config = write_config(tmp_path, {"source": "musdb18hq", "root": str(root), "valid_tracks": valid,
                                     "skip_invalid": skip_invalid})
    locked.chmod(0)
    try:
        proc = prepare(config, tmp_path / "out", tmp_path, rate=16000, prefix=WITHOUT_DAC)
    finally:
        locked.chmod(0o755)
    if not skip_invalid:
        refused(proc, rf"track '{re.escape(locked.name)}': cannot read \S.*/{re.escape(locked.name)}/mixture\.wav "
                      r"\(Permission denied\)$")
        return
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    skipped = json.loads((tmp_path / "out" / MANIFEST).read_text())["skipped"]
    assert [s["name"] for s in skipped] == [locked.name] and "Permission denied" in skipped[0]["reason"]


def test_parallel_prepares_at_two_rates_share_one_generation(tmp_path):
    """The second prepare waits for the synthetic set the first is generating (Snakemake runs the
    prepares of two rates at once), instead of failing on its lock."""
    config = write_config(tmp_path, seed=7)
    raw = tmp_path / "data" / "raw"
    first = subprocess.Popen(command(config, tmp_path / "at8k"), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(first, lambda: temps(raw, "synthetic-*"), "the first prepare's synthetic temporary")
        first.send_signal(signal.SIGSTOP)
        second = subprocess.Popen(command(config, tmp_path / "at16k", rate=16000), cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert second.poll() is None, second.communicate()
    finally:
        first.send_signal(signal.SIGCONT)
    results = [p.communicate(timeout=300) + (p.returncode,) for p in (first, second)]
    assert [r[2] for r in results] == [0, 0], results
    assert re.search(rf"waiting: data.synthetic \S+: in use by pid {first.pid} ", results[1][1])
    assert "generate synthetic MUSDB" in results[0][1] and "generate synthetic MUSDB" not in results[1][1]
    assert len(list(raw.glob("synthetic-*"))) == 1 and not temps(raw, "synthetic-*")
