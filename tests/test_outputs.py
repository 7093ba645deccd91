"""tiersep.outputs: which folders tiersep writes into, one writer per folder, temporaries of a
killed writer, and moving a run aside (issue 19). Real folders and real flocks; the one seam is a
file system without locks (fcntl.flock made to fail as on Lustre without -o flock)."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiersep import outputs


def test_a_new_or_empty_folder_is_claimed_and_stamped(tmp_path):
    for folder in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        outputs.claim(folder, "train")
        assert outputs.read_stamp(folder)["stage"] == "train"
        outputs.claim(folder, "train")       # its own stage again: fine


def test_a_users_folder_is_refused_and_left_untouched(tmp_path):
    folder = tmp_path / "project"
    (folder / "src").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(outputs.OutputRefused, match=r"holds files tiersep did not make \('notes.txt', 'src'\)"):
        outputs.claim(folder, "report")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "src"]


def test_another_stages_folder_is_refused(tmp_path):
    outputs.claim(tmp_path / "run", "train")
    with pytest.raises(outputs.OutputRefused, match="is a tiersep train folder, not a evaluate folder"):
        outputs.claim(tmp_path / "run", "evaluate")


def test_a_folder_of_only_the_stages_own_files_is_adopted(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "scores.json").write_text("{}")
    known = outputs.only_names({"scores.json", "museval"})
    outputs.claim(folder, "evaluate", known=known)
    assert outputs.read_stamp(folder)["stage"] == "evaluate"
    other = tmp_path / "other"
    other.mkdir()
    (other / "scores.json").write_text("{}")
    (other / "thesis.tex").write_text("")
    with pytest.raises(outputs.OutputRefused):
        outputs.claim(other, "evaluate", known=known)


def test_root_home_cwd_and_their_ancestors_are_forbidden(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert outputs.forbidden("/") == "it is the root folder"
    assert outputs.forbidden(Path.home()) == "it is your home folder"
    assert outputs.forbidden(".") == "it is the working directory"
    assert outputs.forbidden(tmp_path.parent) == "it holds the working directory"
    assert outputs.forbidden("sub") is None and outputs.forbidden("new/folder") is None
    with pytest.raises(outputs.OutputRefused, match=r"^--out \.: refused, it is the working directory"):
        outputs.claim(".", "report")


def test_temp_names_are_tiersep_own_only():
    assert outputs.is_temp_name(".model.pt.ab12_xyz.tmp", "model.pt")
    assert outputs.is_temp_name(".8000.k3j4l5m6.tmp", "8000")
    assert not outputs.is_temp_name(".8000.k3j4l5m6.tmp", "800")
    assert not outputs.is_temp_name(".a.b.k3j4l5m6.tmp", "a")      # a temp of "a.b", not of "a"
    assert not outputs.is_temp_name("notes.tmp") and not outputs.is_temp_name(".x.TOOLONG99.tmp")


def test_the_writer_removes_a_killed_writers_temporaries_and_nothing_else(tmp_path):
    folder = outputs.claim(tmp_path / "run", "train")
    stale_beside = tmp_path / ".run.abcd1234.tmp"
    stale_beside.mkdir()
    (stale_beside / "big.wav").write_bytes(b"x" * 1000)
    stale_inside = folder / "checkpoints" / ".last.pt.zz99yy88.tmp"
    stale_inside.parent.mkdir()
    stale_inside.write_bytes(b"half")
    keep = [tmp_path / ".runs.abcd1234.tmp", folder / "my.tmp", folder / "checkpoints" / "last.pt"]
    for path in keep:
        path.write_bytes(b"keep")
    with outputs.exclusive(folder):
        pass
    assert not stale_beside.exists() and not stale_inside.exists()
    assert all(path.read_bytes() == b"keep" for path in keep)


HOLD = """
import sys, time
from tiersep import outputs
with outputs.exclusive(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_writer_stops_at_once_naming_the_holder(tmp_path):
    folder = outputs.claim(tmp_path / "run", "train")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        began = time.time()
        with pytest.raises(outputs.OutputBusy, match=rf"in use by pid {holder.pid} on ") as caught:
            with outputs.exclusive(folder):
                pass
        assert time.time() - began < 2 and caught.value.exit_code == 5
    finally:
        holder.kill()
        holder.wait()
    with outputs.exclusive(folder):   # the kernel released the dead holder's lock: no stale lock
        pass


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    folder = outputs.claim(tmp_path / "run", "train")
    live_temp = folder / ".model.pt.abcd1234.tmp"
    live_temp.write_bytes(b"another writer's, maybe live")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with outputs.exclusive(folder):
        pass
    assert "does not support file locks" in capsys.readouterr().err
    assert live_temp.exists()      # without the lock, nothing can be known stale


def test_move_aside_keeps_everything_and_says_why(tmp_path):
    folder = outputs.claim(tmp_path / "run", "train")
    (folder / "model.pt").write_bytes(b"weights")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.pt").write_bytes(b"ckpt")
    linked = outputs.move_aside(folder, "train.steps grew", names=("model.pt",), link=True)
    assert (folder / "model.pt").read_bytes() == (linked / "model.pt").read_bytes() == b"weights"
    moved = outputs.move_aside(folder, "train.lr changed")
    assert moved != linked and moved.parent == linked.parent == folder / "previous"
    assert (moved / "checkpoints" / "last.pt").read_bytes() == b"ckpt" and not (folder / "model.pt").exists()
    assert json.loads((moved / "moved-aside.json").read_text())["reason"] == "train.lr changed"
    assert outputs.read_stamp(folder) is not None and outputs.move_aside(folder, "again") is None
