"""Reading prepared folders and the training loader: determinism (whatever the worker count),
augmentation bounds, silence rejection, validation segments."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf
import torch

from data_helpers import make_cfg
from tiersep.data.dataset import (MAX_DRAWS, SegmentDataset, dead_worker, make_loader, rms_db,
                                  validation_segments)
from tiersep.data.errors import DataError
from tiersep.data.prepare import prepare
from tiersep.data.tracks import load_manifest, read_stem, read_track, track_names

SOURCES = ["vocals", "drums", "bass", "other"]
SEGMENT = 4000
AUGMENT = {"remix": True, "gain_min": 0.25, "gain_max": 1.25, "channel_swap": True, "silence_db": -60.0}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    out = tmp / "prepared" / "synthetic" / "8000"
    prepare(make_cfg(tmp), out, 8000, progress=False)
    return out


def test_track_names_and_read_track(data_dir):
    manifest = load_manifest(data_dir)
    for split in ("train", "valid", "test"):
        assert track_names(data_dir, split) == manifest["splits"][split] != []
    name = track_names(data_dir, "test")[0]
    mixture, stems = read_track(data_dir, "test", name, SOURCES)
    samples = manifest["tracks"][-1]["samples"]
    assert mixture.shape == (2, samples) and stems.shape == (4, 2, samples)
    assert mixture.dtype == stems.dtype == np.float32
    np.testing.assert_allclose(mixture, stems.sum(axis=0), atol=2e-6)
    for i, source in enumerate(SOURCES):
        assert np.array_equal(stems[i], sf.read(str(data_dir / "test" / name / f"{source}.wav"), dtype="float32")[0].T)
    _, accompaniment = read_track(data_dir, "test", name, ["vocals", "accompaniment"])
    np.testing.assert_allclose(accompaniment[1], stems[1:].sum(axis=0), atol=1e-6)


def test_partial_reads_and_errors(data_dir, tmp_path):
    name = track_names(data_dir, "train")[0]
    whole = read_stem(data_dir, "train", name, "bass")
    assert np.array_equal(read_stem(data_dir, "train", name, "bass", 1000, 500), whole[:, 1000:1500])
    tail = read_stem(data_dir, "train", name, "bass", whole.shape[1] - 100, 300)  # past the end: zeros
    assert tail.shape == (2, 300) and np.array_equal(tail[:, :100], whole[:, -100:]) and not tail[:, 100:].any()
    with pytest.raises(DataError, match="unknown split 'dev'"):
        track_names(data_dir, "dev")
    with pytest.raises(DataError, match=r"manifest.json: not found; is .* a folder written by `tiersep prepare`"):
        load_manifest(tmp_path)
    with pytest.raises(DataError, match=r"model.sources: 'speech1' not in a MUSDB prepared folder"):
        SegmentDataset(data_dir, "train", ["speech1"], SEGMENT, 0, AUGMENT)


def test_same_step_same_batch(data_dir):
    a = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=7, augment=AUGMENT)
    b = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=7, augment=AUGMENT)
    mix, stems = a.batch(12, 3)
    assert mix.shape == (3, 2, SEGMENT) and stems.shape == (3, 4, 2, SEGMENT) and mix.dtype == torch.float32
    a.batch(13, 3)  # what came before does not matter
    for other in (a.batch(12, 3), b.batch(12, 3)):
        assert torch.equal(other[0], mix) and torch.equal(other[1], stems)
    assert not torch.equal(a.batch(14, 3)[0], mix)
    c = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=8, augment=AUGMENT)
    assert not torch.equal(c.batch(12, 3)[0], mix)


def test_loader_content_independent_of_workers_and_resume(data_dir):
    ds = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=1, augment=AUGMENT)
    serial = list(make_loader(ds, 2, num_workers=0, start_step=0, stop_step=6))
    rng_before = torch.get_rng_state()
    parallel = list(make_loader(ds, 2, num_workers=2, start_step=0, stop_step=6))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global torch RNG is left alone
    resumed = make_loader(ds, 2, num_workers=2, start_step=3)  # endless, as the trainer uses it
    resumed = [next(resumed) for _ in range(3)]
    assert [s for s, _, _ in serial] == [s for s, _, _ in parallel] == list(range(6))
    assert [s for s, _, _ in resumed] == [3, 4, 5]
    for (s0, m0, t0), (s1, m1, t1) in zip(serial, parallel):
        assert torch.equal(m0, m1) and torch.equal(t0, t1), s0
    for (s0, m0, t0), (s1, m1, t1) in zip(serial[3:], resumed):
        assert s0 == s1 and torch.equal(m0, m1) and torch.equal(t0, t1)


def test_augmentations_stay_in_bounds(data_dir):
    aug = {**AUGMENT, "gain_min": 0.5, "gain_max": 1.1}
    ds = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=3, augment=aug)
    gains, swaps, mixed_tracks = [], [], 0
    for index in range(24):
        mixture, stems, plan = ds.segment(5, index, with_plan=True)
        by_stem = {p["stem"]: p for p in plan["stems"]}
        mixed_tracks += len({p["track"] for p in plan["stems"]}) > 1 or len({p["offset"] for p in plan["stems"]}) > 1
        for i, source in enumerate(SOURCES):
            p = by_stem[source]
            gains.append(p["gain"])
            swaps.append(p["swap"])
            raw = read_stem(data_dir, "train", p["track"], source, p["offset"], SEGMENT)
            expected = (raw[::-1] if p["swap"] else raw) * np.float32(p["gain"])
            np.testing.assert_allclose(stems[i], expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(mixture, stems.sum(axis=0), atol=1e-6)  # mixture = sum of augmented stems
        assert rms_db(mixture) >= aug["silence_db"]
    assert min(gains) >= 0.5 and max(gains) <= 1.1 and max(gains) - min(gains) > 0.4
    assert 0.25 < np.mean(swaps) < 0.75
    assert mixed_tracks >= 20  # remix: stems from independently drawn tracks and offsets


def test_no_augmentation_is_one_track_and_offset(data_dir):
    ds = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=3, augment=None)
    mixture, stems, plan = ds.segment(0, 0, with_plan=True)
    assert len({(p["track"], p["offset"]) for p in plan["stems"]}) == 1
    assert all(p["gain"] == 1.0 and not p["swap"] for p in plan["stems"])
    track, offset = plan["stems"][0]["track"], plan["stems"][0]["offset"]
    np.testing.assert_allclose(mixture, read_stem(data_dir, "train", track, "mixture", offset, SEGMENT), atol=2e-6)


def test_silent_segments_are_redrawn(data_dir, tmp_path):
    copy = tmp_path / "prepared"
    shutil.copytree(data_dir, copy)
    silent, loud = track_names(copy, "train")[:2]
    for stem in ("mixture", "drums", "bass", "other", "vocals"):  # same size, so the manifest still holds
        path = copy / "train" / silent / f"{stem}.wav"
        data, rate = sf.read(str(path), dtype="float32")
        sf.write(str(path), np.zeros_like(data), rate, subtype="FLOAT")
    ds = SegmentDataset(copy, "train", SOURCES, SEGMENT, seed=0, augment={**AUGMENT, "remix": False})
    plans = [ds.segment(0, i, with_plan=True)[2] for i in range(16)]
    assert all(p["stems"][0]["track"] == loud for p in plans)
    assert any(p["draws"] > 1 for p in plans)  # some first draws hit the silent track and were redrawn
    for stem in ("mixture", "drums", "bass", "other", "vocals"):  # now everything is silent:
        shutil.copy(copy / "train" / silent / f"{stem}.wav", copy / "train" / loud / f"{stem}.wav")
    mixture, _stems, plan = SegmentDataset(copy, "train", SOURCES, SEGMENT, 0, AUGMENT).segment(0, 0, with_plan=True)
    assert plan["draws"] == MAX_DRAWS and not mixture.any()  # bounded: gives up and keeps the last draw


def test_validation_segments_fixed_and_unaugmented(data_dir):
    mix, stems = validation_segments(data_dir, SOURCES, SEGMENT, count=3, seed=0)
    again = validation_segments(data_dir, SOURCES, SEGMENT, count=3, seed=0)
    assert mix.shape == (3, 2, SEGMENT) and stems.shape == (3, 4, 2, SEGMENT)
    assert torch.equal(mix, again[0]) and torch.equal(stems, again[1])
    torch.testing.assert_close(mix, stems.sum(dim=1), atol=2e-6, rtol=0)  # un-augmented: the file's mixture
    name = track_names(data_dir, "valid")[0]
    whole_mixture, _ = read_track(data_dir, "valid", name, SOURCES)
    found = [o for o in range(whole_mixture.shape[1] - SEGMENT + 1)
             if np.array_equal(whole_mixture[:, o:o + SEGMENT], mix[0].numpy())]
    assert found, "segment 0 is a slice of the valid track"
    assert min(rms_db(s.numpy()) for s in stems[0]) > -60


def _worker_pids(parent_pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(parent_pid).children()]


def _wait_gone(pids: list[int], timeout: float) -> bool:
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_workers_ignore_stop_signals_from_others_and_stop_when_closed(data_dir):
    """SIGTERM/SIGINT/SIGUSR1 sent by another process (as Snakemake's or SLURM's signal to the
    whole process group is) leave the workers running; closing the loader ends them."""
    ds = SegmentDataset(data_dir, "train", SOURCES, SEGMENT, seed=5, augment=AUGMENT)
    loader = make_loader(ds, 2, 2, start_step=0)
    assert next(loader)[0] == 0
    workers = _worker_pids(os.getpid())
    assert len(workers) == 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        # `kill` is another process: the sender is not the workers' parent
        subprocess.run(["kill", f"-{sig.name[3:]}", *map(str, workers)], check=True)
    time.sleep(0.5)
    assert [next(loader)[0] for _ in range(6)] == [1, 2, 3, 4, 5, 6]
    assert _worker_pids(os.getpid()) == workers
    loader.close()
    assert _wait_gone(workers, timeout=10), "workers still running after the loader was closed"


# Run in its own process: torch's SIGCHLD handler raises in the main thread, at any bytecode, on
# every SIGCHLD while a dead worker is still registered; make_loader lets only the first through
# (dataset._report_dead_worker_once). Before it, a second raise escaped this script's `except`
# in 3 of 6 runs, and once, inside pytest, ended the session with an INTERNALERROR.
KILL_A_WORKER = """
import json, os, signal, sys, time
import psutil
from tiersep.data.dataset import SegmentDataset, dead_worker, make_loader
ds = SegmentDataset(sys.argv[1], "train", json.loads(sys.argv[2]), int(sys.argv[3]), seed=5,
                    augment=json.loads(sys.argv[4]))
loader = make_loader(ds, 2, 2, start_step=0)
next(loader)
victim = psutil.Process().children()[0].pid
caught = None
try:
    os.kill(victim, signal.SIGKILL)        # what the kernel's OOM killer sends
    for _ in range(50):
        next(loader)
        time.sleep(0.05)
except RuntimeError as err:
    caught = err
print(json.dumps({"victim": victim, "found": dead_worker(caught) if caught else None, "message": str(caught)}))
loader.close()
"""


def test_a_worker_killed_for_real_is_reported_with_pid_and_signal(data_dir):
    proc = subprocess.run([sys.executable, "-c", KILL_A_WORKER, str(data_dir), json.dumps(SOURCES), str(SEGMENT),
                           json.dumps(AUGMENT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    found = out["found"]
    assert found is not None and out["victim"] in found["pids"] and found["signal"] == "SIGKILL", out


def test_a_dead_worker_is_raised_once_however_many_sigchld_follow():
    """make_loader's wrapper of torch's SIGCHLD handler: the first raise goes through, later
    SIGCHLDs (other workers exiting) are dropped; a later loader wraps torch's handler, not it."""
    from tiersep.data import dataset

    calls = []

    def torch_like(signum, frame):      # as torch's: raises while a dead worker is registered
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 41) is killed by signal: Killed. ")

    previous = signal.signal(signal.SIGCHLD, torch_like)
    try:
        restore = dataset._report_dead_worker_once()
        with pytest.raises(RuntimeError, match="pid 41"):
            os.kill(os.getpid(), signal.SIGCHLD)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGCHLD)          # would raise again, unwrapped
        time.sleep(0.1)
        assert len(calls) == 1
        restore()                                     # it raised: the wrapper stays, dropping the rest
        wrapper = signal.getsignal(signal.SIGCHLD)
        assert wrapper.torch_handler is torch_like
        dataset._report_dead_worker_once()            # the next loader's wrapper calls torch's directly
        assert signal.getsignal(signal.SIGCHLD).torch_handler is torch_like
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.mark.parametrize("message, expected", [
    ("DataLoader worker (pid 123) is killed by signal: Killed. ",
     {"pids": [123], "signal": "SIGKILL", "exit_code": None}),
    ("DataLoader worker (pid 9) is killed by signal: Segmentation fault. ",
     {"pids": [9], "signal": "SIGSEGV", "exit_code": None}),
    ("DataLoader worker (pid(s) 77, 78) exited unexpectedly",
     {"pids": [77, 78], "signal": None, "exit_code": None}),
    ("DataLoader worker (pid 5) exited unexpectedly with exit code 1. Details are lost due to multiprocessing.",
     {"pids": [5], "signal": None, "exit_code": 1}),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", None),
])
def test_dead_worker_reads_torch_messages(message, expected):
    assert dead_worker(message) == expected
    assert dead_worker(RuntimeError(message)) == expected


def test_dead_worker_follows_the_cause_for_the_signal():
    try:
        try:
            raise RuntimeError("DataLoader worker (pid 41) is killed by signal: Killed. ")
        except RuntimeError as inner:
            raise RuntimeError("DataLoader worker (pid(s) 41) exited unexpectedly") from inner
    except RuntimeError as outer:
        assert dead_worker(outer) == {"pids": [41], "signal": "SIGKILL", "exit_code": None}
