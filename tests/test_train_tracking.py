"""Watching a run (tiersep.train.tracking): the TensorBoard event files a tiny run writes, read back
with TensorBoard's own EventAccumulator against metrics.csv and memory.csv; a SIGKILLed and resumed
run's curves (every step once); W&B in offline mode, read back from its transaction log; and the
one-line refusals at job start (wandb not importable, a bad mode, online without a key)."""
from __future__ import annotations

import csv
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from test_train_support import REPO, cli_train, make_workspace, metrics_rows, tiny_preset
from tiersep import config as C
from tiersep.train import trainer

# the curves a step logs, beside the metrics.csv column each must equal
TRAIN_CURVES = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm"}
VAL_CURVES = {"val/loss": "val_loss", "val/sdr": "val_sdr", "val/si_sdr": "val_si_sdr"}
SOURCES = ["vocals", "drums", "bass", "other"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("tracking_ws"))


def with_tracking(ws: dict, folder: Path, **tracking) -> dict:
    """The workspace with a config file whose tracking section is `tracking`."""
    raw = yaml.safe_load(Path(ws["config_file"]).read_text())
    raw["tracking"] = tracking
    folder.mkdir(parents=True, exist_ok=True)
    config_file = folder / "config.yaml"
    config_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return {**ws, "config_file": config_file, "cfg": C.load_config(config_file)}


def events(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "audio": 0})
    accumulator.Reload()
    return accumulator


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_curves_match_csv(run: Path, steps: int, validated: list[int]) -> None:
    """Every curve has each step once, with the values metrics.csv and memory.csv hold."""
    acc = events(run)
    rows = {int(r["step"]): r for r in metrics_rows(run)}
    assert sorted(rows) == list(range(1, steps + 1))
    for tag, column in TRAIN_CURVES.items():
        logged = acc.Scalars(tag)
        assert [e.step for e in logged] == list(range(1, steps + 1)), tag
        for e in logged:   # float32 in the event file, 6 digits in the CSV
            assert e.value == pytest.approx(float(rows[e.step][column]), rel=2e-5), (tag, e.step)
    for tag, column in VAL_CURVES.items():
        logged = acc.Scalars(tag)
        assert [e.step for e in logged] == validated, tag
        for e in logged:
            assert e.value == pytest.approx(float(rows[e.step][column]), rel=2e-5, abs=1e-6), (tag, e.step)
    # per-stem SI-SDR: its mean over stems is the row's SI-SDR (each stem's over the same segments)
    for step in validated:
        per_stem = [next(e.value for e in acc.Scalars(f"val/si_sdr_{s}") if e.step == step) for s in SOURCES]
        assert sum(per_stem) / len(per_stem) == pytest.approx(float(rows[step]["val_si_sdr"]), rel=1e-4)
    # the loss's terms: they sum to the validation loss
    for step in validated:
        terms = [next(e.value for e in acc.Scalars(f"val/loss_{t}") if e.step == step) for t in ("time_l1", "stft_l1")]
        assert sum(terms) == pytest.approx(float(rows[step]["val_loss"]), rel=1e-4)
    memory = {int(r["step"]): r for r in read_csv(run / "memory.csv")}
    for tag, column in (("memory/rss_bytes", "allocated"), ("memory/peak_rss_bytes", "peak")):
        logged = acc.Scalars(tag)
        assert [e.step for e in logged] == list(range(1, steps + 1)), tag
        assert all(e.value == pytest.approx(int(memory[e.step][column]), rel=1e-6) for e in logged), tag
    rate = acc.Scalars("train/samples_per_s")
    per_s = {e.step: e.value for e in acc.Scalars("train/steps_per_s")}
    assert all(e.value == pytest.approx(2 * per_s[e.step], rel=1e-5) for e in rate)   # batch 2 x accum 1
    assert all(e.value > 0 for e in acc.Scalars("train/step_time_s"))


def test_a_run_writes_tensorboard_curves_and_audio(ws, tmp_path):
    preset = tiny_preset(**{"train.steps": 6, "train.validate_every": 3, "train.validate_segments": 3})
    out = tmp_path / "run"
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0   # tracking defaults: TensorBoard on
    assert_curves_match_csv(out, 6, [3, 6])
    acc = events(out)
    # 4 s asked for, 3 validation segments of 2000 samples held: all 6000, at the preset's rate
    assert sorted(acc.Tags()["audio"]) == sorted(f"audio/{n}" for n in ["mixture", *SOURCES])
    for name in ["mixture", *SOURCES]:
        clips = acc.Audio(f"audio/{name}")
        assert [(c.step, c.sample_rate, c.length_frames) for c in clips] == [(3, 8000, 6000), (6, 8000, 6000)]
        assert all(c.encoded_audio_string[:4] == b"RIFF" for c in clips)


def test_sigkill_then_resume_continues_the_curves(ws, tmp_path):
    """A run killed past its checkpoint wrote events the resumed run redoes: TensorBoard's reader
    shows every step once (purge_step), with the resumed run's values, which metrics.csv holds."""
    sets = ["--set", "train.steps=16", "--set", "train.checkpoint_every=5", "--set", "train.validate_every=4"]
    out = tmp_path / "killed"
    proc = cli_train(ws, out, *sets)
    deadline = time.time() + 120
    while len(metrics_rows(out)) < 7 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    checkpoint = torch.load(out / "checkpoints" / "last.pt", weights_only=False)["step"]
    logged = [e.step for e in events(out).Scalars("train/loss")]
    # the premise: the killed process logged steps its checkpoint does not hold
    assert checkpoint in (5, 10) and max(logged) > checkpoint, (checkpoint, logged)

    assert cli_train(ws, out, *sets, "--resume").wait(timeout=300) == 0
    assert json.loads((out / "run.json").read_text())["resumed_from"] == checkpoint
    assert_curves_match_csv(out, 16, [4, 8, 12, 16])
    for name in ["mixture", *SOURCES]:
        assert [c.step for c in events(out).Audio(f"audio/{name}")] == [4, 8, 12, 16], name


# ------------------------------------------------------------------------------ Weights & Biases
def wandb_records(path: Path):
    """The records of a W&B transaction log (run-<id>.wandb): a 7-byte header (":W&B", magic,
    version), then LevelDB-style log blocks of 32 KiB holding chunks [crc32, length, type, data]
    (types 1 full, 2 first, 3 middle, 4 last) of serialized wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:            # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> dict:
    """{curve: {step: value}} of the logged history, and the run's config."""
    history, config = {}, {}
    for record in wandb_records(run_file):
        if record.HasField("history"):
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                history.setdefault(key, {})[step] = json.loads(item.value_json)
        elif record.HasField("config"):
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif record.HasField("run"):
            for item in record.run.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config


def test_wandb_offline_logs_the_same_curves_and_the_preset(ws, tmp_path):
    tracked = with_tracking(ws, tmp_path / "cfg", tensorboard=False,
                            wandb={"project": "tiersep-test", "mode": "offline"})
    out = tmp_path / "run"
    sets = ["--set", "train.steps=4", "--set", "train.validate_every=2"]
    # no key, no network: offline needs neither
    env = {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9", "HOME": str(tmp_path / "home")}
    assert cli_train(tracked, out, *sets, env=env).wait(timeout=300) == 0
    assert not (out / "tb").exists()
    runs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history, config = wandb_history(runs[0])
    rows = {int(r["step"]): r for r in metrics_rows(out)}
    for tag, column in {**TRAIN_CURVES, **VAL_CURVES}.items():
        expected = {s: float(r[column]) for s, r in rows.items() if r[column]}
        assert sorted(history[tag]) == sorted(expected), tag
        assert all(history[tag][s] == pytest.approx(v, rel=1e-5, abs=1e-6) for s, v in expected.items()), tag
    assert sorted(history["memory/rss_bytes"]) == [1, 2, 3, 4]
    for name in ["mixture", *SOURCES]:   # audio: a wav per validation in the run's files/
        clips = history[f"audio/{name}/path"]
        assert sorted(clips) == [2, 4] and all((runs[0].parent / "files" / p).is_file() for p in clips.values())
    assert config["preset"]["name"] == "train_test_tiny"
    assert config["preset"]["train"]["steps"] == 4
    assert config["estimate"]["device"] == "cpu"
    # the run's id is in its checkpoints, so a resumed run continues the same W&B run
    run_id = runs[0].stem.removeprefix("run-")
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=False)["run"]["wandb_id"] == run_id


def cli_error(tmp_path: Path, config_file: Path, prelude: str = "", env: dict | None = None):
    """`tiersep train` in a real subprocess (after `prelude`): (exit code, stderr, the run folder).
    Its --data has a manifest (checked first) and nothing else: tracking is checked before data is read."""
    out, data = tmp_path / "run", tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "manifest.json").write_text("{}")
    argv = ["train", "--config", str(config_file), "--preset", "train_test_tiny",
            "--data", str(data), "--out", str(out)]
    code = f"{prelude}\nimport sys\nfrom tiersep.cli import main\nsys.exit(main({argv!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=120)
    return done.returncode, done.stderr.strip(), out


# A finder first on sys.meta_path that refuses wandb and its submodules: wandb absent, for real.
HIDE_WANDB = """
import sys
class HideWandb:
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideWandb())
"""


def test_wandb_missing_a_bad_mode_or_no_key_is_one_line_at_job_start(ws, tmp_path):
    asked = with_tracking(ws, tmp_path / "asked", wandb={"project": "p"})
    code, err, out = cli_error(tmp_path, asked["config_file"], HIDE_WANDB)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tracking.wandb.project" in err and "wandb" in err and str(asked["config_file"]) in err
    assert not out.exists()   # nothing started: no run folder

    bad = tmp_path / "bad" / "config.yaml"
    bad.parent.mkdir()
    raw = yaml.safe_load(Path(ws["config_file"]).read_text())
    bad.write_text(yaml.safe_dump({**raw, "tracking": {"wandb": {"project": "p", "mode": "onlin"}}}))
    code, err, out = cli_error(tmp_path, bad)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tracking.wandb.mode" in err and "onlin" in err and not out.exists()

    online = with_tracking(ws, tmp_path / "online", wandb={"project": "p", "mode": "online"})
    (tmp_path / "netrc").write_text("")
    code, err, out = cli_error(tmp_path, online["config_file"],
                               env={"WANDB_API_KEY": "", "NETRC": str(tmp_path / "netrc")})
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tracking.wandb.mode is online" in err and "WANDB_API_KEY" in err and not out.exists()


def test_curve_names_follow_the_row_keys():
    """A score a later validation adds (an EMA's, say) needs no change here: its key names its curve."""
    from tiersep.train.tracking import curve_name, memory_curves

    assert curve_name("val_si_sdr_ema") == "val/si_sdr_ema" and curve_name("grad_norm") == "train/grad_norm"
    sample = {"allocated": 1, "reserved": 2, "peak": 3, "device": None}
    assert memory_curves(sample, "cuda") == {"memory/allocated_bytes": 1, "memory/reserved_bytes": 2,
                                             "memory/peak_bytes": 3}
    assert memory_curves(sample, "cpu") == {"memory/rss_bytes": 1, "memory/peak_rss_bytes": 3}
