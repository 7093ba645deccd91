"""The CPU fit gate's booking of a whole train process (tiersep.memory.cpu_booking).

Unit tests of the booking and its inverse, of configure_malloc()'s effect and of the peak-RSS
measurement; then real `tiersep train` processes (three tiny presets, one checkpointed, validation
after every step, the export at the end) whose measured peak RSS the booking must cover within
1.0-1.25x. Real components throughout: the real trace estimate, trainer, data and glibc.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import load_script, one_torch_thread
from test_train_support import make_workspace, tiny_preset
from tiersep import malloc, probe
from tiersep.memory import cpu_booking as cpu_process
from tiersep.memory.estimate import estimate

MIB, GIB = 2**20, 2**30
ON_GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


# ------------------------------------------------------------------------------ booking / budget
PRESET = {"model": {"checkpointing": False}, "train": {"host_malloc": "auto"}}


def test_booking_parts_add_up_and_grow_with_the_live_bytes():
    small = cpu_process.booking({"peak_bytes": 10 * MIB}, PRESET)
    large = cpu_process.booking({"peak_bytes": 4 * GIB}, PRESET)
    for b in (small, large):
        for mode in ("glibc_default", "tuned"):
            m = b[mode]                      # the exit pages take the room the heap gave back
            assert m["run_rss_bytes"] == int(b["process_bytes"] - b["exit_pages_bytes"]
                                             + m["live_factor"] * b["live_bytes"])
            assert m["rss_bytes"] == max(m["run_rss_bytes"], b["process_bytes"])
            assert f"{b['process_bytes'] // MIB} MiB" in m["model"] and str(m["live_factor"]) in m["model"]
            assert m["live_factor"] >= 1.0       # the live tensors are never booked at less than their size
        assert b["malloc"] == "glibc_default" and b["rss_bytes"] == b["glibc_default"]["rss_bytes"]  # no budget
    assert small["live_bytes"] == 10 * MIB and large["live_bytes"] == 4 * GIB
    assert large["run_rss_bytes"] - small["run_rss_bytes"] == pytest.approx(
        large["live_factor"] * (4 * GIB - 10 * MIB), abs=2)


def test_the_booking_counts_the_exit_pages_once(monkeypatch):
    """The exit pages reuse the room of the freed tensors (tuned: unmapped; glibc's own: the
    trainer gives the heap back before exit), so the life's peak is the larger of the run's and
    the exit's: the allowance for a small preset, the run's for a large one."""
    fake = {"process_bytes": 1000 * MIB, "probe_peak_bytes": 952 * MIB, "exit_pages_bytes": 100 * MIB,
            "source": "measured: x"}
    monkeypatch.setattr(cpu_process, "process_allowance", lambda: fake)
    small = cpu_process.booking({"peak_bytes": 50 * MIB}, PRESET)        # the factor x 50 MiB < the exit pages
    large = cpu_process.booking({"peak_bytes": 1000 * MIB}, PRESET)
    for mode, factor in (("tuned", cpu_process.LIVE_FACTOR), ("glibc_default", cpu_process.GLIBC_DEFAULT_FACTOR)):
        assert small[mode]["rss_bytes"] == 1000 * MIB
        assert small[mode]["run_rss_bytes"] == int(900 * MIB + factor * 50 * MIB)
        assert large[mode]["rss_bytes"] == large[mode]["run_rss_bytes"] == int(900 * MIB + factor * 1000 * MIB)


def test_checkpointing_is_booked_with_the_heap_trim_the_trainer_applies():
    """With glibc's own malloc a checkpointed preset is booked as trimmed around each block (the
    trainer does so: trims_heap), at the factor of a step without checkpointing, whose range its
    growth then stays in; the tuned malloc never trims."""
    plain = cpu_process.booking({"peak_bytes": GIB}, PRESET)
    checkpointed = cpu_process.booking({"peak_bytes": GIB}, {**PRESET, "model": {"checkpointing": True}})
    assert checkpointed["glibc_default"]["rss_bytes"] == plain["glibc_default"]["rss_bytes"]
    assert "trimmed around each checkpointed block" in checkpointed["glibc_default"]["model"]
    assert "trimmed" not in plain["glibc_default"]["model"] and checkpointed["tuned"] == plain["tuned"]
    ckpt = {"model": {"checkpointing": True}}
    assert cpu_process.trims_heap(ckpt, "glibc_default") and not cpu_process.trims_heap(ckpt, "tuned")
    assert not cpu_process.trims_heap({"model": {"checkpointing": False}}, "glibc_default")


# A real process: 1 MiB buffers kept in glibc's heap (mmap threshold raised, as glibc's dynamic
# threshold does after a large free), each followed by a small allocation that stays, as autograd's
# C++ objects stay between a block's activations; the buffers are then freed: their pages stay
# resident in the fenced holes until malloc_trim gives the whole free pages back.
_FENCED_HOLES = """
import ctypes, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cpu_process", sys.argv[1])   # without torch: its import
cpu_process = importlib.util.module_from_spec(spec)                          # leaves free small chunks
spec.loader.exec_module(cpu_process)                                         # the fences would reuse
trimmed_heap = cpu_process.trimmed_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]; libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.mallopt(-3, 64 << 20)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
drain = [libc.malloc(64) for _ in range(100000)]   # the free small chunks: the fences come from the top
big, fences = [], []
for _ in range(256):
    p = libc.malloc(1 << 20); libc.memset(p, 1, 1 << 20); big.append(p)
    fences.append(libc.malloc(64))
for p in big:
    libc.free(p)
before = rss()
with trimmed_heap():
    inside = rss()
print(json.dumps({"before": before, "inside": inside}))
"""


@pytest.mark.skipif(not ON_GLIBC, reason="malloc_trim is glibc's")
def test_trimmed_heap_gives_the_pages_of_fenced_holes_back():
    proc = subprocess.run([sys.executable, "-c", _FENCED_HOLES, malloc.__file__],
                          text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    # 256 MiB sat in the holes; the trim returns all but the pages the fences and chunk headers touch
    assert rss["before"] - rss["inside"] > 200 * MIB, rss


def test_the_budget_chooses_glibcs_malloc_when_it_fits_else_the_tuned_one():
    booked = cpu_process.booking({"peak_bytes": 1 * GIB}, PRESET)
    default, tuned = booked["glibc_default"]["rss_bytes"], booked["tuned"]["rss_bytes"]
    assert default > tuned
    roomy = int(default / 0.92) + 1
    assert cpu_process.choose_malloc(booked, roomy, 0.08)["malloc"] == "glibc_default"
    tight = cpu_process.choose_malloc(booked, int(tuned / 0.92) + 1, 0.08)  # only the tuned booking fits
    assert tight["malloc"] == "tuned" and tight["rss_bytes"] == tuned and "64 KiB" in tight["model"]
    forced = cpu_process.booking({"peak_bytes": 1 * GIB}, {**PRESET, "train": {"host_malloc": "tuned"}})
    assert cpu_process.choose_malloc(forced, roomy, 0.08)["malloc"] == "tuned"      # train.host_malloc wins
    old = {"rss_bytes": 5, "live_bytes": 1}                                        # a booking from before modes
    assert cpu_process.choose_malloc(old, 1, 0.08) == old


def test_process_allowance_is_measured_here_and_moves_with_what_the_probe_holds(monkeypatch):
    """The allowance is a probe train process's measured peak RSS plus RUN_BYTES: a probe that
    holds 256 MiB more is booked 256 MiB more, not a constant's worth."""
    measured = cpu_process.process_allowance()
    assert measured["source"].startswith("measured"), measured
    assert 200 * MIB < measured["probe_peak_bytes"] < 4 * GIB       # torch alone maps hundreds of MiB
    assert measured["process_bytes"] == measured["probe_peak_bytes"] + cpu_process.RUN_BYTES
    if ON_GLIBC:   # Linux: the probe read its own peak before exit; C++ destructors touch pages after
        assert 0 < measured["exit_pages_bytes"] < measured["probe_peak_bytes"]
    booked = cpu_process.booking({"peak_bytes": 64 * MIB}, PRESET)
    assert booked["run_rss_bytes"] == int(measured["process_bytes"] - measured["exit_pages_bytes"]
                                          + booked["live_factor"] * 64 * MIB)
    assert booked["rss_bytes"] == max(booked["run_rss_bytes"], measured["process_bytes"])
    probes = {}
    for mib in (256, 512):    # held through the probe's steps, above its exit-time peak
        monkeypatch.setattr(cpu_process, "TRAIN_IMPORTS", f"import torch; held = b'x' * ({mib} * 2**20)")
        probes[mib] = cpu_process.measure_process_allowance()["process_bytes"]
    assert probes[512] - probes[256] == pytest.approx(256 * MIB, abs=16 * MIB)


def test_the_probe_takes_real_training_steps():
    """The probe runs the trainer's own step on the smallest model: its losses are finite and move."""
    code = cpu_process.TRAIN_IMPORTS + cpu_process._PROBE
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = report["losses"]
    assert len(losses) == cpu_process.PROBE_STEPS and all(abs(x) < 1e3 for x in losses)
    assert losses[0] != losses[1]                     # AdamW changed the weights between the steps
    assert report["peak_before_exit_bytes"] > 200 * MIB


def test_process_allowance_is_measured_once_per_boot_and_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    fake = {"process_bytes": 900 * MIB, "probe_peak_bytes": 852 * MIB, "exit_pages_bytes": 0, "source": "measured: x"}
    monkeypatch.setattr(cpu_process, "measure_process_allowance", lambda: calls.append(1) or dict(fake))
    first = cpu_process.process_allowance.__wrapped__()
    second = cpu_process.process_allowance.__wrapped__()
    cache = cpu_process.allowance_cache_file()
    if cache is None:            # no boot id (not Linux): every process measures
        assert len(calls) == 2
        return
    assert len(calls) == 1 and first == fake and cache.parent == tmp_path / "tiersep"
    assert second == {**fake, "cache_file": str(cache)}
    cache.write_text("{not json")                      # a damaged file is measured again
    assert cpu_process.process_allowance.__wrapped__() == fake and len(calls) == 2
    stale = time.time() - cpu_process.ALLOWANCE_MAX_AGE_S - 1
    os.utime(cache, (stale, stale))                    # the page cache has moved on: measured again
    assert cpu_process.process_allowance.__wrapped__() == fake and len(calls) == 3
    assert cpu_process.process_allowance.__wrapped__() == {**fake, "cache_file": str(cache)}
    assert len(calls) == 3
    fallback = {**fake, "probe_peak_bytes": None, "source": "fallback (x)"}
    cache.unlink()
    monkeypatch.setattr(cpu_process, "measure_process_allowance", lambda: dict(fallback))
    cpu_process.process_allowance.__wrapped__()
    assert not cache.exists()                          # a fallback is never kept


def test_process_allowance_falls_back_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_process.sys, "executable", "/nonexistent/python")
    fallback = cpu_process.measure_process_allowance()
    assert fallback["process_bytes"] == cpu_process.FALLBACK_PROCESS_BYTES
    assert fallback["source"].startswith("fallback (") and fallback["probe_peak_bytes"] is None


# ------------------------------------------------------------------------------ configure_malloc
# Children load cpu_process by path (it needs only the standard library), so they start in a
# fraction of a second instead of importing torch through tiersep.memory.
LOAD_CPU_PROCESS = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("cpu_process", {str(Path(malloc.__file__))!r})
cpu_process = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_process)
"""
FRAGMENT = LOAD_CPU_PROCESS + """
import ctypes, json, os, sys
applied = cpu_process.configure_malloc() if sys.argv[1] == "tuned" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def buffer(n):                    # as torch's CPU allocator: malloc, then write every page
    p = libc.malloc(n); ctypes.memset(p, 1, n); return p
for n in (2**20, 2**21):          # free a 1 and a 2 MiB buffer: glibc's dynamic threshold climbs
    libc.free(buffer(n))
base = rss()
big, pins = [], []
for _ in range(100):              # 1 MiB buffers, each followed by a 32 KiB one that stays
    big.append(buffer(2**20))
    pins.append(buffer(2**15))
for p in big:
    libc.free(p)
print(json.dumps({"applied": applied, "retained": rss() - base}))
"""


@pytest.mark.skipif(not ON_GLIBC, reason="mallopt settings are glibc's")
def test_configure_malloc_returns_freed_tensor_buffers_to_the_kernel():
    """100 x 1 MiB freed between pinned 32 KiB buffers: glibc's defaults keep the holes resident
    (the fragmentation that made a checkpointed step grow ~1.9x its live bytes); with
    configure_malloc() they go back."""
    out = {}
    for variant in ("default", "tuned"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        proc = subprocess.run([sys.executable, "-c", FRAGMENT, variant], text=True, capture_output=True,
                              env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tuned"]["applied"] == {"allocator": "glibc", "applied": True,
                                       "mmap_threshold": malloc.MMAP_THRESHOLD,
                                       "trim_threshold": malloc.TRIM_THRESHOLD}
    assert out["default"]["retained"] > 60 * MIB      # the pattern does fragment glibc's heap
    assert out["tuned"]["retained"] < 10 * MIB


def test_malloc_env_names_the_same_settings():
    env = malloc.malloc_env()
    assert env == {"MALLOC_MMAP_THRESHOLD_": str(malloc.MMAP_THRESHOLD),
                   "MALLOC_TRIM_THRESHOLD_": str(malloc.TRIM_THRESHOLD)}


# ------------------------------------------------------------------------------ measuring RSS
ALLOCATE_64MIB = "b = bytearray(64 * 2**20)"


def test_measured_peak_is_the_commands_own_not_its_parents():
    """A child's ru_maxrss starts at its parent's high-water mark: measured directly from this
    (pytest + torch) process, a 64 MiB command would read as this process's peak."""
    hold = bytearray(768 * MIB)   # make sure this process's high-water mark is well above the child's
    del hold
    measured = probe.measure_peak_rss([sys.executable, "-c", ALLOCATE_64MIB])
    assert measured["returncode"] == 0
    assert 64 * MIB <= measured["peak_rss_bytes"] < 160 * MIB
    direct = subprocess.Popen([sys.executable, "-c", ALLOCATE_64MIB])
    _, _, usage = os.wait4(direct.pid, 0)
    assert usage.ru_maxrss * 1024 >= 768 * MIB        # why the launcher is needed


def test_measure_peak_rss_reports_the_exit_code_and_kills_on_timeout():
    assert probe.measure_peak_rss([sys.executable, "-c", "raise SystemExit(3)"])["returncode"] == 3
    with pytest.raises(subprocess.TimeoutExpired):
        probe.measure_peak_rss([sys.executable, "-c", "import time; time.sleep(60)"], timeout=2)


def test_own_peak_rss_sees_an_allocation_in_this_process():
    """telemetry.peak_rss_bytes (run.json's peak_rss_bytes, the probe's pre-exit peak) is this
    process's own: it grows by what the process allocates."""
    code = "from tiersep.probe import peak_rss_bytes as peak\n" \
        "a = peak(); b = bytearray(96 * 2**20); print(peak() - a)"
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 90 * MIB <= int(proc.stdout.strip()) < 110 * MIB


# ------------------------------------------------------------------------------ accumulation (issue 21)
def test_train_step_frees_each_micro_batchs_graph_before_the_next_forward():
    """Issue 21's cause: train_step kept the previous micro-batch's estimates and loss, and with
    them its whole autograd graph, alive through the next forward. The graph's small C++ nodes,
    allocated between the activations, fenced the heap holes the freed activations left, and
    glibc's posix_memalign(64) asks 96 bytes more than an exact hole, so the next micro-batch's
    activations could not reuse them: 4.4-4.6 GiB instead of 3.5-3.6 (docs/memory.md). Each
    graph carries a sentinel in its output node's metadata, which dies with the graph."""
    import weakref

    import torch

    from tiersep.model import build_loss, build_model
    from tiersep.model.step import make_optimizer, train_step

    preset = tiny_preset(**{"model.dropout": 0.0, "train.grad_accum": 3})
    torch.manual_seed(0)
    model, loss_fn = build_model(preset), build_loss(preset)

    class Sentinel:
        pass

    graphs, alive_at_forward = [], []
    model.register_forward_pre_hook(lambda m, args: alive_at_forward.append(sum(g() is not None for g in graphs)))

    def keep_sentinel(module, args, out):
        sentinel = Sentinel()
        out.grad_fn.metadata["sentinel"] = sentinel
        graphs.append(weakref.ref(sentinel))

    model.register_forward_hook(keep_sentinel)
    shape = (2, 2, preset["audio"]["segment_samples"])
    batches = [(torch.randn(shape), torch.randn(2, 4, *shape[1:])) for _ in range(3)]
    with one_torch_thread():
        loss, _ = train_step(model, loss_fn, make_optimizer(model, preset, "cpu"), batches, preset, "cpu")
    assert len(graphs) == 3 and torch.isfinite(loss)
    assert alive_at_forward == [0, 0, 0]         # was [0, 1, 1]: the graph of the micro-batch before
    assert all(g() is None for g in graphs)


# ------------------------------------------------------------------------------ real train processes
RUN = {"model.dropout": 0.0, "train.steps": 2, "train.validate_every": 1, "train.checkpoint_every": 2,
       "train.validate_segments": 2}
TRAINED = {
    "plain": {},
    "checkpointed": {"model.n_layers": 3, "model.checkpointing": True},
    "accumulated": {"audio.segment_samples": 6000, "model.emb_dim": 16, "model.attention_dim": 16,
                    "train.grad_accum": 2},
    "checkpointed_tuned": {"model.n_layers": 3, "model.checkpointing": True, "train.host_malloc": "tuned"},
}


def train_in_parallel(root: Path, ws: dict, presets: dict, timeout: float = 240) -> dict:
    """Train each preset in its own real `tiersep train` process, all at once; returns each one's
    cpu_process.measure_peak_rss result."""
    results, errors = {}, []

    def train(name):
        preset_file = root / f"{name}.yaml"
        preset_file.write_text(yaml.safe_dump(presets[name], sort_keys=False))
        cmd = [sys.executable, "-m", "tiersep.cli", "train", "--config", str(ws["config_file"]), "--preset",
               str(preset_file), "--data", str(ws["data"]), "--out", str(root / name)]
        try:
            with open(root / f"{name}.log", "w") as log:
                results[name] = probe.measure_peak_rss(
                    cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, log=log, timeout=timeout)
        except Exception as err:  # noqa: BLE001 - reported by the test
            errors.append(f"{name}: {err}")

    threads = [threading.Thread(target=train, args=(name,)) for name in presets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Booking (no budget: what auto picks with plenty of RAM) and measured peak RSS of each TRAINED
    preset, trained in parallel processes."""
    root = tmp_path_factory.mktemp("cpu_rss")
    with one_torch_thread():
        ws = make_workspace(root)
        presets = {name: dict(tiny_preset(**RUN, **sets), name=f"rss_{name}") for name, sets in TRAINED.items()}
        bookings = {name: estimate(p, "trace", "cpu")["cpu_process"] for name, p in presets.items()}
    results = train_in_parallel(root, ws, presets)
    return {"root": root, "presets": presets, "bookings": bookings, "results": results}


@pytest.mark.slow   # four real train processes in parallel: ~40 s on two idle cores, ~80 s on busy ones
@pytest.mark.parametrize("name", list(TRAINED))
def test_booking_covers_the_real_train_process_within_25_percent(trained, name):
    result, booking = trained["results"][name], trained["bookings"][name]
    log = (trained["root"] / f"{name}.log").read_text()
    assert result["returncode"] == 0, log[-3000:]
    run = json.loads((trained["root"] / name / "run.json").read_text())
    assert run["steps"] == RUN["train.steps"]
    # the trainer ran the malloc mode the booking assumes (auto: glibc's own, RAM is plentiful here)
    assert booking["malloc"] == ("tuned" if "tuned" in name else "glibc_default")
    assert run["malloc"]["applied"] is (booking["malloc"] == "tuned"), run["malloc"]
    ratio = booking["rss_bytes"] / result["peak_rss_bytes"]
    assert 1.0 <= ratio <= 1.25, (
        f"{name}: booked {booking['rss_bytes'] / MIB:.0f} MiB ({booking['model']}, live "
        f"{booking['live_bytes'] / MIB:.1f} MiB) vs real peak {result['peak_rss_bytes'] / MIB:.0f} MiB")
    # what the report compares: the booking before exit vs the run's own peak before exit (VmHWM)
    in_run = booking["run_rss_bytes"] / run["peak_rss_bytes"]
    assert 1.0 <= in_run <= 1.25, (f"{name}: booked {booking['run_rss_bytes'] / MIB:.0f} MiB before exit vs the "
                                   f"run's own peak {run['peak_rss_bytes'] / MIB:.0f} MiB")


# ------------------------------------------------------------------------------ random presets (issue 21)
# Two presets drawn as `bench/cpu_rss.py --random` draws them (draw_preset, issue 21's ranges), by
# seed, among the draws at the 8 kHz of the test data: 104 accumulates (8 kHz, 1.78 s, n_fft
# 1024/256, 2 x 48, micro-batch 1 x 2: 711 MiB live, every activation below glibc's 32 MiB mmap
# ceiling, i.e. in its heap), 143 checkpoints (8 kHz, 1.74 s, n_fft 256/64, 1 x 24), with 2 loader
# workers and 3 steps. Measured here (2 busy cores, 2026-11-25, the model of this commit: the
# exit pages counted once, 1.5 x live): 104 booked 1.11x its real peak (1601-1602 MiB; the same
# before exit), and 0.97x with train_step as it was before issue 21's fix; 143 1.14-1.19x
# (1295-1349 MiB), with its heap trimmed around each block (1.28-1.34x booked at 2.0 x live, the
# exit pages on top, before the trim).
RANDOM_SEEDS = {"accumulating": 104, "checkpointed": 143}


def draw_random_preset(seed: int) -> tuple[dict, str]:
    import random

    bench = Path(__file__).resolve().parents[1] / "bench" / "cpu_rss.py"
    module = load_script(bench, "cpu_rss_bench")
    preset, what, _ = module.draw_preset(random.Random(seed))
    return dict(preset, name=f"random_{seed}"), what


@pytest.fixture(scope="module")
def random_trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_rss_random")
    with one_torch_thread():
        ws = make_workspace(root)
        drawn = {name: draw_random_preset(seed) for name, seed in RANDOM_SEEDS.items()}
        presets = {name: preset for name, (preset, _) in drawn.items()}
        records = {name: estimate(p, "trace", "cpu") for name, p in presets.items()}
    results = train_in_parallel(root, ws, presets, timeout=400)
    return {"root": root, "presets": presets, "what": {n: w for n, (_, w) in drawn.items()}, "records": records,
            "results": results}


@pytest.mark.slow   # two real train processes in parallel: ~1 min on two busy cores
@pytest.mark.parametrize("name", list(RANDOM_SEEDS))
def test_booking_covers_random_presets_trained_for_real(random_trained, name):
    """The gate's booking (what auto picks: glibc's own malloc) is at least the real peak RSS of the
    whole train process, exit included, and at least the run's own peak before exit."""
    preset, record = random_trained["presets"][name], random_trained["records"][name]
    result, booking = random_trained["results"][name], random_trained["records"][name]["cpu_process"]
    log = (random_trained["root"] / f"{name}.log").read_text()
    assert result["returncode"] == 0, log[-3000:]
    if name == "accumulating":       # what the draw must give for the case to test issue 21
        assert preset["train"]["grad_accum"] >= 2 and record["peak_bytes"] > 512 * MIB
        assert record["largest_allocation_bytes"] < 32 * MIB      # every activation in glibc's heap
    else:
        assert preset["model"]["checkpointing"] and preset["train"]["num_workers"] == 2
    run = json.loads((random_trained["root"] / name / "run.json").read_text())
    assert run["steps"] == preset["train"]["steps"] and booking["malloc"] == "glibc_default"
    assert run["malloc"]["applied"] is False, run["malloc"]
    # the heap is trimmed around each checkpointed block, as the booking assumes
    assert run["malloc"]["trim_heap"] is preset["model"]["checkpointing"], run["malloc"]
    said = (f"{name} ({random_trained['what'][name]}): booked {booking['rss_bytes'] / MIB:.0f} MiB "
            f"({booking['model']}, live {booking['live_bytes'] / MIB:.0f} MiB)")
    assert booking["rss_bytes"] >= result["peak_rss_bytes"], f"{said} vs real peak {result['peak_rss_bytes'] / MIB:.0f} MiB"
    assert booking["run_rss_bytes"] >= run["peak_rss_bytes"], (
        f"{said}: {booking['run_rss_bytes'] / MIB:.0f} MiB before exit vs the run's own peak "
        f"{run['peak_rss_bytes'] / MIB:.0f} MiB")
    # Where the estimate matters (issue 34, item 2): the live bytes are most of the booking, and the
    # run's growth above the process allowance (before exit) is judged against the booking's
    # factor x live bytes part, the part the estimator decides. Measured here (2026-11-27, 2 busy
    # cores, 2 runs): 0.816-0.847 (accumulating: 870-903 MiB grown for 1.5 x 711 MiB) and
    # 0.742-0.766 (checkpointed: 613-633 MiB for 1.5 x 550); on the CI machine (fresh clone,
    # 2026-11-27) 0.827 and 0.812 above its 985 MiB allowance; earlier runs' peaks put the checkpointed one at 0.69-0.76. Above 1 the booking
    # misses; the lower bounds are the measured spread plus the CI machine's margin, so a live
    # estimate far too high fails as well.
    above = booking["process_bytes"] - booking["exit_pages_bytes"]
    live_part = booking["live_factor"] * booking["live_bytes"]
    # the live part's share: 0.53-0.60 here, 0.46-0.52 on the CI machine (its fresh install's
    # allowance is 1164 MiB, not 843: large folios)
    assert live_part / booking["run_rss_bytes"] >= 0.4, f"{said}: the live bytes are not a real share of it"
    growth = (run["peak_rss_bytes"] - above) / live_part
    low = {"accumulating": 0.70, "checkpointed": 0.60}[name]
    assert low <= growth <= 1.0, (f"{said}: the run grew {(run['peak_rss_bytes'] - above) / MIB:.0f} MiB above the "
                                  f"{above / MIB:.0f} MiB process, {growth:.3f} x the booked live part")
