"""Training loop (issue 6): schedules, accumulation, outputs, refusals, injected OOM + retry.

Real TF-Locoformer, real loss, real data pipeline (a tiny prepared synthetic set), real fit gate.
"""
from __future__ import annotations

import csv
import json
import math
import weakref

import pytest
import torch

from conftest import one_torch_thread
from test_train_support import make_workspace, tiny_preset
from tiersep import config as C
from tiersep.train import build, loop, oom, trainer
from tiersep.train.schedule import Schedule
from tiersep.model.step import make_optimizer, train_step
from tiersep.train.telemetry import METRICS_FIELDS, CsvLog


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    with one_torch_thread():
        yield make_workspace(tmp_path_factory.mktemp("train_ws"))


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------- schedules
def schedule_of(**train):
    base = {"schedule": "cosine", "steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1,
            "plateau_patience": 2, "plateau_factor": 0.5}
    return Schedule({**base, **train})


def test_cosine_warms_up_linearly_then_decays_to_the_floor():
    s = schedule_of()
    f = [s.factor(i) for i in range(100)]
    warm = f[:10]
    assert all(b > a for a, b in zip(warm, warm[1:])) and 0 < warm[0] < 0.2
    diffs = [b - a for a, b in zip(warm, warm[1:])]
    assert max(diffs) - min(diffs) < 1e-12  # linear
    assert f[10] == pytest.approx(1.0)
    decay = f[10:]
    assert all(b <= a for a, b in zip(decay, decay[1:]))
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=0.02)  # half-way: mean of 1 and the floor
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and min(decay) >= 0.1


def test_constant_and_plateau_schedules():
    const = schedule_of(schedule="constant")
    assert [const.factor(i) for i in (10, 50, 99)] == [1.0, 1.0, 1.0]
    plateau = schedule_of(schedule="plateau")
    assert plateau.factor(20) == 1.0
    plateau.observe(1.0)               # best
    plateau.observe(0.9)               # better
    plateau.observe(0.95)              # worse (1 of 2)
    assert plateau.factor(50) == 1.0
    plateau.observe(0.91)              # worse (2 of 2): halve
    assert plateau.factor(50) == 0.5
    for _ in range(20):
        plateau.observe(5.0)
    assert plateau.factor(60) == pytest.approx(0.1)  # never below min_lr_ratio
    restored = schedule_of(schedule="plateau")
    restored.load_state_dict(plateau.state_dict())
    assert restored.factor(60) == plateau.factor(60) and restored.best == plateau.best


# ------------------------------------------------------------------------------ accumulation
def test_accumulation_equals_one_large_batch(ws):
    """batch 4 in one step == 2 micro-batches of 2 == 4 of 1 (real model, loss, data, AdamW)."""
    from tiersep.data.dataset import SegmentDataset
    from tiersep.model import build_loss, build_model

    preset = tiny_preset(**{"model.dropout": 0.0})
    data = SegmentDataset(ws["data"], "train", preset["model"]["sources"],
                          preset["audio"]["segment_samples"], 0, preset["train"]["augment"])
    mixture, stems = data.batch(0, 4)  # [4, C, S], [4, n, C, S]
    results = []
    for micro in (4, 2, 1):
        torch.manual_seed(0)
        model = build_model(preset)
        optimizer = make_optimizer(model, preset, "cpu")
        chunks = list(zip(mixture.split(micro), stems.split(micro)))
        loss, norm = train_step(model, build_loss(preset), optimizer, chunks, preset, "cpu")
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((float(loss), float(norm), grads, [p.detach().clone() for p in model.parameters()]))
    (loss4, norm4, grads4, params4) = results[0]
    for loss, norm, grads, params in results[1:]:
        assert loss == pytest.approx(loss4, rel=1e-5)
        assert norm == pytest.approx(norm4, rel=1e-4)
        for g, g4 in zip(grads, grads4):
            torch.testing.assert_close(g, g4, rtol=1e-4, atol=1e-7)
        # Adam's first update is lr * g / (|g| + eps): the few gradients near eps amplify rounding,
        # so the weights are compared to 5 % of one update (the gradients above are the real test).
        lr = preset["train"]["lr"]
        for p, p4 in zip(params, params4):
            torch.testing.assert_close(p, p4, rtol=0, atol=0.05 * lr)
    # ...and the check can fail: a different batch gives a different gradient.
    torch.manual_seed(0)
    model = build_model(preset)
    train_step(model, build_loss(preset), make_optimizer(model, preset, "cpu"),
               [(mixture[:2], stems[:2])], preset, "cpu")
    assert not torch.allclose(next(model.parameters()).grad, grads4[0])


def test_trainer_with_accumulation_matches_the_large_batch(ws, tmp_path):
    """Through train(): 4 x 1 and 2 x 2 and 1 x 4 give the same weights after 3 steps."""
    weights, logged = {}, {}
    for micro, accum in ((4, 1), (2, 2), (1, 4)):
        preset = tiny_preset(**{"model.dropout": 0.0, "train.batch_size": micro,
                                "train.grad_accum": accum, "train.steps": 3})
        out = tmp_path / f"b{micro}x{accum}"
        assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0
        weights[(micro, accum)] = torch.load(out / "checkpoints" / "last.pt", weights_only=False)["model"]
        assert json.loads((out / "run.json").read_text())["effective_batch"] == 4
        logged[(micro, accum)] = [(float(r["loss"]), float(r["grad_norm"])) for r in read_csv(out / "metrics.csv")]
    lr = preset["train"]["lr"]
    for other in ((2, 2), (1, 4)):
        # Same loss and gradient norm at every step (a scaling bug in the split shows here: it puts
        # both >= 50 % off, a factor 2 or 1/2 or more)...
        # The gradient norm is compared to 1 %, not closer: float32 rounding decides the sign of an
        # L1 term whose error lies within rounding of zero, and one flipped sign of the N = 64000
        # moves the gradient by 2/N * d(estimate)/d(weight). Measured on an Intel Xeon (AVX-512,
        # oneDNN), 2026-11-26: after step 1 the splits' weights differ in the last bits (at most 4e-7:
        # the micro-batches' gradients summed in another order), and at step 2 one split's estimate
        # of a silent stem's sample came out +6.5e-10 where the 4 x 1 run's was -5.0e-9 and float64
        # gives -1.7e-8: that split's grad_norm 0.12 % off at step 2 and 0.29 % at step 3, while the
        # loss stays within 1.1e-6 and the 4 x 1 norm within 2e-5 of a float64 step. 1 % is 3x that
        # spread and 50x below a scaling bug.
        for (loss, norm), (loss4, norm4) in zip(logged[other], logged[(4, 1)]):
            assert loss == pytest.approx(loss4, rel=1e-4) and norm == pytest.approx(norm4, rel=1e-2)
        # ...and the same weights, to a fraction of one Adam update per step (measured with the
        # flipped sign above: 0.06 lr).
        for key, value in weights[(4, 1)].items():
            torch.testing.assert_close(weights[other][key], value, rtol=0, atol=0.15 * lr)


def test_the_heap_is_given_back_once_the_runs_model_is_gone(ws, tmp_path, monkeypatch):
    """train() gives glibc's free heap pages back (cpu_process.release_heap) after the run's model
    is freed, so the library pages the exit touches take their room: the CPU booking counts those
    pages once (docs/memory.md). Called earlier, the freed model's pages would stay in the heap."""
    models, released = [], []
    real_build = loop.build

    def spied_build(run):
        real_build(run)
        models.append(weakref.ref(run.model))

    monkeypatch.setattr(loop, "build", spied_build)
    monkeypatch.setattr(trainer, "release_heap", lambda: released.append([ref() is None for ref in models]))
    assert trainer.train(ws["cfg"], tiny_preset(**{"train.steps": 2}), ws["data"], tmp_path / "run") == 0
    assert released == [[True]]


# ----------------------------------------------------------------------------------- outputs
def test_a_run_writes_every_output(ws, tmp_path):
    preset = tiny_preset(**{"train.steps": 6, "train.validate_every": 3, "train.checkpoint_every": 2})
    out = tmp_path / "run"
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == 0
    for name in ("model.pt", "run.json", "metrics.csv", "memory.csv", "checkpoints/last.pt",
                 "checkpoints/best.pt"):
        assert (out / name).is_file(), name
    assert not (out / "failure.json").exists()
    metrics = read_csv(out / "metrics.csv")
    assert list(metrics[0]) == METRICS_FIELDS
    assert [int(r["step"]) for r in metrics] == [1, 2, 3, 4, 5, 6]
    validated = [int(r["step"]) for r in metrics if r["val_si_sdr"]]
    assert validated == [3, 6]
    assert all(math.isfinite(float(r["val_sdr"])) for r in metrics if r["val_sdr"])
    lrs = [float(r["lr"]) for r in metrics]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[2]  # warm-up, then decay
    memory = read_csv(out / "memory.csv")
    # device: the process's device use on a GPU (total - free), empty on CPU
    assert list(memory[0]) == ["step", "allocated", "reserved", "peak", "device"] and len(memory) == 6
    assert all(int(r["peak"]) >= int(r["allocated"]) > 0 for r in memory)
    run = json.loads((out / "run.json").read_text())
    for key in ("preset", "pid", "host", "device", "start_free_bytes", "peak_allocated_bytes",
                "peak_reserved_bytes", "wall_seconds", "steps", "steps_per_s", "attention_backend",
                "precision", "batch_size", "grad_accum", "attempt", "resumed_from", "versions", "estimate"):
        assert key in run, key
    assert run["steps"] == 6 and run["device_type"] == "cpu" and run["resumed_from"] is None
    assert run["start_free_bytes"] > 0 and run["peak_allocated_bytes"] >= max(int(r["peak"]) for r in memory)
    assert run["peak_rss_bytes"] >= run["start_rss_bytes"] > 0 and run["allocator"] is None
    assert set(run["versions"]) == {"python", "torch", "torchaudio", "tiersep", "cuda"}
    assert run["estimate"]["peak_bytes"] > 0 and run["estimate"]["device"] == "cpu"
    model = torch.load(out / "model.pt", weights_only=False)
    assert set(model) >= {"model", "preset", "step"} and model["preset"]["name"] == preset["name"]
    best = max((float(r["val_si_sdr"]), int(r["step"])) for r in metrics if r["val_si_sdr"])
    assert model["step"] == best[1] == run["best"]["step"]


def test_loader_workers_do_not_change_the_run(ws, tmp_path):
    """Batches come from worker processes or from this one: the same weights, bit for bit."""
    weights = []
    for workers in (0, 2):
        preset = tiny_preset(**{"train.steps": 3, "train.num_workers": workers})
        assert trainer.train(ws["cfg"], preset, ws["data"], tmp_path / f"w{workers}") == 0
        weights.append(torch.load(tmp_path / f"w{workers}" / "checkpoints" / "last.pt", weights_only=False)["model"])
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_bf16_autocast_runs_on_cpu(ws, tmp_path):
    preset = tiny_preset(**{"train.steps": 2, "train.precision": "bf16"})
    assert trainer.train(ws["cfg"], preset, ws["data"], tmp_path / "bf16") == 0
    run = json.loads((tmp_path / "bf16" / "run.json").read_text())
    assert run["precision"] == "bf16" and math.isfinite(run["best"]["val_si_sdr"])


def test_csv_log_resume_drops_later_and_torn_rows(tmp_path):
    path = tmp_path / "m.csv"
    log = CsvLog(path, ["step", "loss"], None)
    for step in range(1, 6):
        log.append({"step": step, "loss": step / 10})
    log.close()
    with open(path, "a") as f:
        f.write("6,0.")  # a row cut short by SIGKILL
    log = CsvLog(path, ["step", "loss"], keep_until_step=3)
    log.append({"step": 4, "loss": 0.44})
    log.close()
    assert path.read_text() == "step,loss\n1,0.1\n2,0.2\n3,0.3\n4,0.44\n"


# --------------------------------------------------------------------------------- refusals
def test_gpu_sized_preset_is_refused_on_cpu(ws, tmp_path, capsys):
    preset = C.load_preset("small", {"presets_dir": str(C.PACKAGE_DIR.parents[1] / "config" / "presets")})
    preset["train"]["device"] = "cpu"
    out = tmp_path / "small"
    assert trainer.train(ws["cfg"], preset, ws["data"], out) == trainer.EXIT_REFUSED
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "refused" and "GPU-sized" in failure["message"]
    assert "allow_cpu" in capsys.readouterr().err
    assert not (out / "model.pt").exists() and not (out / "checkpoints").exists()


def test_fit_gate_refusal_exits_3_before_training(ws, tmp_path, monkeypatch, capsys):
    """The real gate against a budget the tiny run cannot fit (available RAM faked to 64 MiB)."""
    import psutil

    real = psutil.virtual_memory()
    fake = real._replace(available=64 * 2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    out = tmp_path / "gated"
    assert trainer.train(ws["cfg"], tiny_preset(), ws["data"], out) == trainer.EXIT_REFUSED
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "refused" and failure["estimate_peak_bytes"] > 0
    assert "exceeds the budget" in capsys.readouterr().err
    assert not (out / "metrics.csv").exists() and not (out / "model.pt").exists()


def test_on_oversize_adapt_trains_the_variant_that_fits(ws, tmp_path, monkeypatch, capsys):
    """on_oversize: adapt. With the RAM available set just below what micro-batch 16 x 1 of 1 s
    books even with the tuned malloc (the booking's process allowance is measured on this machine:
    ~830 MiB here), the trainer trains the variant tiersep.memory.fit derives (same effective batch).
    Its live bytes (~450 MiB) are well above the ~117 MiB of pages a process touches only at exit,
    which the tuned booking never goes below: micro-batch 8 books ~250 MiB less."""
    import psutil

    from tiersep.memory.estimate import estimate

    preset = tiny_preset(**{"train.batch_size": 16, "train.grad_accum": 1, "audio.segment_samples": 8000,
                            "model.dropout": 0.0, "train.steps": 2, "train.validate_every": 2})
    cfg = {**ws["cfg"], "on_oversize": "refuse"}
    tuned = estimate(preset, "trace", "cpu")["cpu_process"]["tuned"]["rss_bytes"]
    available = int(tuned / (1 - cfg["estimate"]["safety_margin"])) - 16 * 2**20
    fake = psutil.virtual_memory()._replace(available=available)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    assert trainer.train(cfg, preset, ws["data"], tmp_path / "refused") == trainer.EXIT_REFUSED
    out = tmp_path / "adapted"
    assert trainer.train({**cfg, "on_oversize": "adapt"}, preset, ws["data"], out) == trainer.EXIT_OK
    run = json.loads((out / "run.json").read_text())
    assert run["adapted"]["changes"] and "exceeds the budget" in run["adapted"]["reason"]
    assert run["batch_size"] < 16 and run["batch_size"] * run["grad_accum"] == 16
    assert run["preset"] == preset["name"]
    assert "adapted" in capsys.readouterr().err


# ------------------------------------------------------------------------------ OOM + retry
def test_injected_oom_writes_failure_and_the_retry_downshifts(ws, tmp_path, monkeypatch):
    """A mock of a GPU out-of-memory error (none can happen on this CPU-only machine): the hook
    raises torch.OutOfMemoryError, with CUDA's message, at step 3 while the micro-batch is above 1.
    Attempt 1 must record it and exit 4 leaving no model.pt/run.json; attempt 2 (what Snakemake's
    `retries` runs) must resume with half the micro-batch and twice the accumulation."""
    monkeypatch.setenv(trainer.INJECT_OOM_ENV, "step=3,max_batch=1")
    preset = tiny_preset(**{"train.steps": 6, "train.checkpoint_every": 2})
    out = tmp_path / "oom"
    assert trainer.train(ws["cfg"], preset, ws["data"], out, resume=True, attempt=1) == trainer.EXIT_OOM
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "oom" and failure["step"] == 3
    assert failure["attempted_allocation_bytes"] == 2 * 2**30
    assert failure["estimate_peak_bytes"] > 0 and failure["estimate_largest_allocation_bytes"] > 0
    assert (failure["batch_size"], failure["grad_accum"]) == (2, 1)
    assert not (out / "model.pt").exists() and not (out / "run.json").exists()

    assert trainer.train(ws["cfg"], preset, ws["data"], out, resume=True, attempt=2) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["attempt"], run["batch_size"], run["grad_accum"]) == (2, 1, 2)
    assert run["downshifted_from"] == {"batch_size": 2, "grad_accum": 1}
    assert run["recovered_from"]["kind"] == "oom" and run["resumed_from"] == 2
    assert not (out / "failure.json").exists()
    assert [int(r["step"]) for r in read_csv(out / "metrics.csv")] == list(range(1, 7))


def test_oom_helpers():
    assert oom.attempted_allocation("CUDA out of memory. Tried to allocate 80.89 GiB (GPU 0)") \
        == int(80.89 * 2**30)
    assert oom.attempted_allocation("Tried to allocate 512.00 MiB") == 512 * 2**20
    assert oom.attempted_allocation("something else") is None
    assert oom.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not oom.is_oom(RuntimeError("shape mismatch"))
    assert oom.downshift(8, 1) == (4, 2) and oom.downshift(3, 2) == (1, 6)
    assert oom.downshift(1, 4) == (1, 4)


# ------------------------------------------------------------------------------ torch.compile
def test_compiled_training_matches_eager_and_records_the_compile(ws, tmp_path, monkeypatch):
    """train.compile true on CPU: the run trains through the torch.compile'd model (fullgraph,
    Dynamo + AOTAutograd; the aot_eager backend keeps this test to seconds, inductor's code
    generation is tested in test_model_compile), run.json records it with the compile's first-step
    time, and the weights stay close to an eager run's (same data, same seed)."""
    monkeypatch.setenv(build.COMPILE_BACKEND_ENV, "aot_eager")
    steps = {"train.steps": 2, "train.validate_every": 2, "train.checkpoint_every": 2, "model.dropout": 0.0}
    eager_out, compiled_out = tmp_path / "train" / "eager", tmp_path / "train" / "compiled"
    assert trainer.train(ws["cfg"], tiny_preset(**steps), ws["data"], eager_out) == 0
    assert trainer.train(ws["cfg"], tiny_preset(**steps, **{"train.compile": True}), ws["data"], compiled_out) == 0
    run = json.loads((compiled_out / "run.json").read_text())
    assert run["compile"]["requested"] is True and run["compile"]["compiled"] is True, run["compile"]
    assert run["compile"]["first_step_seconds"] > 0 and run["compile"]["reason"] is None
    assert run["compile"]["backend"] == "aot_eager"
    eager = json.loads((eager_out / "run.json").read_text())["compile"]
    assert eager["compiled"] is False and "train.compile auto on cpu" in eager["reason"]
    a = torch.load(eager_out / "model.pt", weights_only=False)["model"]
    b = torch.load(compiled_out / "model.pt", weights_only=False)["model"]
    assert a.keys() == b.keys()   # the checkpoint holds the eager model's names, no wrapper prefix
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4)


def test_a_failed_compile_rechecks_the_gate_for_the_eager_step(ws, tmp_path, monkeypatch):
    """The gate booked the compiled step (train.compile true): when compiling fails, the run goes on
    eagerly only after the eager step's estimate is checked against the budget; a refusal then is
    recorded like the gate's own (exit 3, failure.json kind refused, the compile's cause named)."""
    from tiersep import memory

    monkeypatch.setenv(build.COMPILE_BACKEND_ENV, "no_such_backend")   # torch.compile refuses it
    steps = {"train.steps": 1, "train.validate_every": 1, "train.checkpoint_every": 1, "model.dropout": 0.0,
             "train.compile": True}
    out = tmp_path / "train" / "fits"
    assert trainer.train(ws["cfg"], tiny_preset(**steps), ws["data"], out) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["compile"]["compiled"] is False and "no_such_backend" in run["compile"]["reason"]
    assert "the eager step's estimate" in run["compile"]["regated"]
    assert run["estimate"]["compiled"] is False          # what the gate checked last: the eager step

    real_gate = memory.gate

    def refuse_eager(preset, device_type, budget, settings, **kwargs):   # the compiled step fits, eager not
        if kwargs.get("compiled") is not False:
            return real_gate(preset, device_type, budget, settings, **kwargs)
        raise memory.DoesNotFit("preset tiny: estimated peak 9 GiB exceeds the budget", {"peak_bytes": 9 * 2**30})

    monkeypatch.setattr(memory, "gate", refuse_eager)
    refused = tmp_path / "train" / "refused"
    assert trainer.train(ws["cfg"], tiny_preset(**steps), ws["data"], refused) == 3
    failure = json.loads((refused / "failure.json").read_text())
    assert failure["kind"] == "refused" and "torch.compile failed" in failure["message"]
    assert "exceeds the budget" in failure["message"] and not (refused / "model.pt").exists()
