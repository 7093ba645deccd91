"""`tiersep separate` under disk and permission faults, and the state of --out between runs: the
real CLI in its own process, on a tiny trained tier (test_separate's fixtures). Every fault ends in
one line with a documented exit code and leaves no half file."""
from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tiersep.data.prepare import FREE_BYTES_ENV

from test_separate import STEMS, last_line, run, sidecar, songs, synthetic_song, temporaries, ws  # noqa: F401 (fixtures)

# As root, the DAC capabilities make every folder writable; setpriv drops them from the bounding
# set so the command it starts meets the permissions a user meets (as tests/test_prepare_safety.py).
WITHOUT_DAC = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
MODEL_LOADED = "tiersep separate: train_test_tiny on cpu"     # the line printed once the model is ready


def everything(folder: Path) -> list[str]:
    """Every name under `folder` but tiersep's stamp and lock (nothing else may be left by a fault)."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name not in (".tiersep", ".tiersep.lock"))


@contextlib.contextmanager
def small_disk(tmp_path: Path):
    """A 2 MiB file system (a real tmpfs when this process may mount one), as (folder, preexec).
    Without mount rights: an ordinary folder and a 2 MiB file size limit for the command (its
    writes then fail as on a full disk, with EFBIG; SIGXFSZ is ignored so they fail, not kill)."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    if mounted:
        try:
            yield folder, None
        finally:
            subprocess.run(["umount", str(folder)], check=True)
        return

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))

    yield folder, limit


def cli(ws, *args, prefix=(), env=None, preexec=None) -> subprocess.CompletedProcess:
    from test_separate import REPO, TIERSEP

    cmd = [*prefix, TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(ws["model"]),
           "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, preexec_fn=preexec,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# ------------------------------------------------------------------------------ disk and permissions
@pytest.mark.parametrize("options", [[], ["--format", "flac", "--bits", "24", "--clip", "clamp"]],
                         ids=["wav rescale", "flac"])
def test_a_disk_that_fills_up_fails_the_song_in_one_line_with_no_half_file(ws, tmp_path, options):
    song = tmp_path / "noise.wav"          # 12 s of noise: its 4 stems take 3.4 MB even as flac
    sf.write(song, np.random.default_rng(0).standard_normal((44100 * 12, 2)).astype(np.float32) * 0.1, 44100)
    with small_disk(tmp_path) as (disk, preexec):
        out = disk / "out"
        # the free-space check would refuse first: pretend the space is there, so the disk fills meanwhile
        proc = cli(ws, str(song), "--out", str(out), *options,
                   env={FREE_BYTES_ENV: str(1 << 40)}, preexec=preexec)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = last_line(proc)
        stem = r"\w+\.flac" if options else r"\w+\.wav"       # whichever stem's write met the full disk
        full = (rf"no space left on {re.escape(str(out))}/noise \(\d+ KiB free\); free some space or give "
                r"--out on another disk$")
        limited = r"cannot write it \(.+\); the file size limit of this process is 2097152 bytes \(ulimit -f\)$"
        assert re.search(rf"^tiersep separate: error: \S+/noise\.wav: {re.escape(str(out))}/noise/"
                         rf"{stem}: ({full if preexec is None else limited})", line), line
        assert everything(out) == [] and not temporaries(out)


def test_a_song_whose_stems_do_not_fit_the_free_space_is_refused_before_it_starts(ws, songs, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.wav").write_bytes((songs / "nested" / "stereo 44k.flac").read_bytes())
    out = tmp_path / "out"
    proc = run(ws, str(songs / "nested" / "stereo 44k.flac"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    need = sum(p.stat().st_size for p in (out / "stereo 44k").glob("*.wav"))       # 2.0 MiB
    # 18 MiB free: the 16 MiB margin and less than the stems
    proc = cli(ws, str(songs / "short.wav"), str(folder / "a.wav"), "--out", str(tmp_path / "out2"),
               env={FREE_BYTES_ENV: str(18 << 20)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"error: 1 of 2 songs failed: \S+/a\.wav: not enough free disk space: writing its 4 stems needs about "
                     r"(\d+\.\d) MiB \(\+ 16\.0 MiB margin\) but \S+ has 18\.0 MiB free; free some space", last_line(proc))
    booked = float(re.search(r"needs about (\d+\.\d) MiB", last_line(proc)).group(1)) * 2**20
    # the stems (each with a header allowance), whatever the clip mode: rescale keeps no float32 copies
    assert need * 0.98 <= booked <= need * 1.2
    assert (tmp_path / "out2" / "short" / "vocals.wav").is_file()     # the song that fits was written
    assert not (tmp_path / "out2" / "a").exists() and not temporaries(tmp_path / "out2")


@pytest.mark.skipif(os.geteuid() == 0 and not WITHOUT_DAC, reason="unreachable")
def test_an_output_folder_that_cannot_be_written_is_refused_before_the_model_loads(ws, songs, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    song = str(songs / "short.wav")
    try:
        proc = cli(ws, song, "--out", str(locked), prefix=WITHOUT_DAC)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.fullmatch(rf"tiersep separate: error: --out {re.escape(str(locked))}: cannot be written "
                            r"\(permission denied\); give a folder you can write", last_line(proc))
        assert MODEL_LOADED not in proc.stderr
        new = locked / "new"
        proc = cli(ws, song, "--out", str(new), prefix=WITHOUT_DAC)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.fullmatch(rf"tiersep separate: error: --out {re.escape(str(new))}: cannot be made: "
                            rf"{re.escape(str(locked))} cannot be written \(permission denied\); give a folder "
                            r"you can write", last_line(proc))
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


def test_a_writable_output_folder_in_a_parent_that_is_not_is_separated(ws, songs, tmp_path):
    scratch = tmp_path / "scratch"                      # /scratch/$USER/out: the parent is someone else's
    out = scratch / "out"
    out.mkdir(parents=True)
    scratch.chmod(0o555)
    try:
        proc = cli(ws, str(songs / "short.wav"), "--out", str(out), prefix=WITHOUT_DAC)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(os.listdir(scratch)) == ["out"]    # the lock is inside --out, not beside it
        assert (out / ".tiersep.lock").is_file() and (out / "short" / "vocals.wav").is_file()
    finally:
        scratch.chmod(0o755)


def test_a_second_writer_is_refused_at_once_naming_the_whole_command(ws, songs, tmp_path):
    from tiersep.outputs import claim, exclusive

    out = claim(tmp_path / "out", "separate")
    command = [sys.argv[0], "--an-option-to-make-the-command-long", *(f"argument-{i}" for i in range(30))]
    saved, sys.argv = sys.argv, command
    try:
        with exclusive(out, inside=True):                # a first run holding the folder (a real flock)
            proc = run(ws, str(songs / "short.wav"), "--out", str(out))
    finally:
        sys.argv = saved
    assert proc.returncode == 5
    line = last_line(proc)
    assert re.search(rf"--out \S+/out: in use by pid {os.getpid()} on .*: {re.escape(' '.join(command))}\); wait for "
                     r"it to finish \(the lock is \S+/out/\.tiersep\.lock", line), line
    assert MODEL_LOADED not in proc.stderr and everything(out) == []


# ------------------------------------------------------------------------------ names and reruns
def test_a_file_name_that_makes_no_output_path_fails_that_song_alone(ws, songs, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "...mp3").write_bytes((songs / "nested" / "mono 22k.mp3").read_bytes())   # its song name: '..'
    (folder / "good.wav").write_bytes((songs / "short.wav").read_bytes())
    out = tmp_path / "out"
    proc = cli(ws, str(folder / "...mp3"), str(folder / "good.wav"), "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"error: 1 of 2 songs failed: \S+/in/\.\.\.mp3: its name cannot make an output path "
                     r"\(--filename '\{song\}/\{stem\}\.\{ext\}': gives '\.\./vocals\.wav', which is not a path inside --out\); rename the file$", last_line(proc))
    assert (out / "good" / "vocals.wav").is_file()
    assert sorted(os.listdir(tmp_path)) == ["in", "out"] and sorted(os.listdir(folder)) == ["...mp3", "good.wav"]


def test_an_input_folder_that_is_the_output_folder_is_refused_naming_out(ws, songs, tmp_path):
    music = tmp_path / "music"
    music.mkdir()
    (music / "a.wav").write_bytes((songs / "short.wav").read_bytes())
    for out in (music, music / ".." / "music"):
        proc = cli(ws, str(music), "--out", str(out))
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.fullmatch(rf"tiersep separate: error: --out {re.escape(str(out))}: the INPUT folder "
                            rf"{re.escape(str(music))} is it; give the stems a folder of their own \(it may be "
                            r"inside the INPUT folder\)", last_line(proc))
    proc = cli(ws, str(music / "sub"), "--out", str(music))          # an input inside --out: refused too
    assert proc.returncode == 2 and "INPUT" in last_line(proc)
    assert sorted(os.listdir(music)) == ["a.wav"]


def test_a_rerun_with_other_stems_leaves_the_folder_matching_its_sidecar(ws, songs, tmp_path):
    out = tmp_path / "out"
    song = songs / "short.wav"
    assert run(ws, str(song), "--out", str(out)).returncode == 0
    (out / "short" / "my notes.txt").write_text("mine")                  # the user's: never removed
    proc = run(ws, str(song), "--out", str(out), "--stems", "vocals")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = sidecar(out, "short")
    assert sorted(os.listdir(out / "short")) == ["my notes.txt", "no_vocals.wav", "separate.json", "vocals.wav"]
    assert record["stems"] == {"vocals": str(out / "short" / "vocals.wav"),
                               "no_vocals": str(out / "short" / "no_vocals.wav")}
    assert record["input"] == str(song) and record["model"] == str(ws["model"])
    assert all(os.path.isabs(p) for p in (record["input"], record["model"], *record["stems"].values()))
    # and back to every stem: no_vocals goes, as the new sidecar lists only the four
    assert run(ws, str(song), "--out", str(out)).returncode == 0
    assert sorted(os.listdir(out / "short")) == ["bass.wav", "drums.wav", "my notes.txt", "other.wav",
                                                  "separate.json", "vocals.wav"]


def test_stems_follow_the_umask(ws, songs, tmp_path):
    out = tmp_path / "out"
    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        proc = cli(ws, str(songs / "short.wav"), "--out", str(out / oct(mask)), preexec=lambda m=mask: os.umask(m))
        assert proc.returncode == 0, proc.stderr[-3000:]
        for path in (out / oct(mask) / "short").iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == mode, (path, oct(path.stat().st_mode))


# ------------------------------------------------------------------------------ what a song holds on disk
def as_written(stems: np.ndarray, gain: float) -> np.ndarray:
    """What a 16-bit wav holds of float32 stems [n, C] times `gain` (libsndfile's own rounding)."""
    import io

    buffer = io.BytesIO()
    sf.write(buffer, stems * np.float32(gain), 44100, subtype="PCM_16", format="WAV")
    buffer.seek(0)
    return sf.read(buffer, dtype="int16")[0]


def test_rescale_holds_no_more_disk_than_the_stems_and_writes_what_it_did(ws, tmp_path):
    """--clip rescale (the default) on a real 2 MiB tmpfs: the stems of a song beyond full scale take
    1.1 MB there, the float32 temporaries it used to write beside them 2.5 MB (the disk would fill).
    Each sample is still the computed one (as --clip none --bits 32f writes it) times the song's
    gain, rounded once: a loud song is written twice (its first pass finds the gain), a quiet one once."""
    track = synthetic_song(1.6, 44100, seed=2)["mixture"]
    loud, quiet = tmp_path / "loud.wav", tmp_path / "quiet.wav"
    sf.write(loud, 8 * track[:70000], 44100, subtype="FLOAT")
    sf.write(quiet, 0.05 * track[:20000], 44100, subtype="FLOAT")
    common = [str(loud), str(quiet), "--chunk", "1", "--batch", "1"]
    raw = cli(ws, *common, "--out", str(tmp_path / "raw"), "--clip", "none", "--bits", "32f")
    assert raw.returncode == 0, raw.stderr[-3000:]
    with small_disk(tmp_path) as (disk, preexec):
        if preexec is not None:
            pytest.skip("needs a real tmpfs (mount): a file size limit does not bound the disk a song holds")
        out = disk / "out"
        proc = cli(ws, *common, "--out", str(out), env={FREE_BYTES_ENV: str(1 << 40)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"\[1/2\] loud: its stems went beyond full scale: separating it again, scaled by 0\.\d+",
                         proc.stderr)
        for song, passes in (("loud", 2), ("quiet", 1)):
            report = sidecar(out, song)["clipping"]
            computed = sidecar(tmp_path / "raw", song)["clipping"]["stems"]
            peak = max(s["peak"] for s in computed.values())
            assert report["passes"] == passes and report["stems"] == computed
            assert report["gain"] == (pytest.approx(1 / (1.01 * peak)) if passes == 2 else 1.0)
            assert (peak > 1.0) == (passes == 2)
            for stem in STEMS:
                written = sf.read(out / song / f"{stem}.wav", dtype="int16")[0]
                stems = sf.read(tmp_path / "raw" / song / f"{stem}.wav", dtype="float32")[0]
                np.testing.assert_array_equal(written, as_written(stems, report["gain"]))
        assert not temporaries(out)


def test_a_disk_that_fills_up_with_the_sidecar_leaves_no_stem_without_it(ws, songs, tmp_path):
    """The sidecar is written before any stem is renamed: a real tmpfs with room for exactly the
    stems (and tiersep's stamp and lock) fails the song whole, in one line, with nothing left."""
    song = str(songs / "short.wav")
    pretend = {FREE_BYTES_ENV: str(1 << 40)}       # past the free-space check's 16 MiB margin
    clamp = ("--clip", "clamp")                     # one pass whatever the song's peak: the runs match
    with small_disk(tmp_path) as (disk, preexec):
        if preexec is not None:
            pytest.skip("needs a real tmpfs (mount) to fill to the page")
        out = disk / "out"

        def free() -> int:
            stats = os.statvfs(disk)
            return stats.f_bavail * stats.f_frsize

        empty = free()
        proc = cli(ws, song, "--out", str(out), *clamp, env=pretend)
        assert proc.returncode == 0, proc.stderr[-3000:]
        used = empty - free()
        sidecar_bytes = (out / "short" / "separate.json").stat().st_blocks * 512
        assert 0 < sidecar_bytes < used
        subprocess.run(["rm", "-r", str(out)], check=True)
        with open(disk / "filler", "wb") as filler:       # leaves free what the run used, but its sidecar
            filler.write(b"\0" * (empty - (used - sidecar_bytes)))
        assert free() == used - sidecar_bytes
        proc = cli(ws, song, "--out", str(out), *clamp, env=pretend)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert re.fullmatch(rf"tiersep separate: error: \S+/short\.wav: {re.escape(str(out))}/short/separate\.json: "
                            rf"no space left on {re.escape(str(out))}/short \(0 KiB free\); free some space or give "
                            r"--out on another disk", last_line(proc)), last_line(proc)
        assert everything(out) == [] and not temporaries(out)
        assert not out.exists()                   # the run made --out and wrote nothing: it is gone again


def test_two_runs_racing_for_a_new_output_folder_one_is_refused_before_its_model_loads(ws, tmp_path):
    """Both start together (a barrier file) on an --out that does not exist yet: the one that takes
    the lock separates, the other is refused at once (exit 5), before it loads its model."""
    from test_separate import REPO, TIERSEP

    song = tmp_path / "long.wav"                        # long enough that the winner outlasts the loser's start
    sf.write(song, np.random.default_rng(0).standard_normal((8000 * 20, 2)).astype(np.float32) * 0.1, 8000)
    out, go = tmp_path / "new" / "out", tmp_path / "go"
    cmd = [TIERSEP, "separate", "--config", str(ws["config_file"]), "--model", str(ws["model"]), "--device", "cpu",
           str(song), "--out", str(out), "--chunk", "1", "--batch", "1"]
    barrier = f'while [ ! -e "{go}" ]; do sleep 0.01; done; exec "$@"'
    runs = [subprocess.Popen(["sh", "-c", barrier, "sh", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    go.touch()
    results = sorted(((run_.pid, run_.communicate(timeout=300)[1], run_.returncode) for run_ in runs),
                     key=lambda r: r[2])
    assert [r[2] for r in results] == [0, 5], [r[1][-2000:] for r in results]
    (winner, won, _), (_, lost, _) = results
    assert MODEL_LOADED in won and MODEL_LOADED not in lost
    assert re.search(rf"--out {re.escape(str(out))}: in use by (pid {winner} on .*: {re.escape(' '.join(cmd))}\)|"
                     r"another process); wait for it", lost.splitlines()[-1]), lost[-2000:]
    assert everything(out) == sorted(["long", "long/separate.json", *(f"long/{s}.wav" for s in STEMS)])
