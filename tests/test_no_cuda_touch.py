"""Only jobs that use the GPU touch CUDA: `tiersep prepare`, `estimate`, `fit` and `report` with
`budget_gib: auto` run, as real processes, with every way into CUDA made to fail and recorded
(a sitecustomize.py on PYTHONPATH). A context opened by such a job took about 1 GiB from a
training job beside it on the H100 (tests/data/gpu/h100-2026-11-22/README.md, "Sweep")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import yaml

from conftest import REPO, TINY_CONFIG
from tiersep import gpu_info

# Installed in every process started by the test: each entry point into CUDA records its name in
# $CUDA_TOUCH_LOG and raises (recording first, so a caller that swallows the error is still seen).
# is_available() and device_count() are refused to tiersep's own code only: they open no context
# (cudaGetDeviceCount runs cuInit, which allocates no device memory), and torch's FakeTensorMode,
# which the trace estimate runs under, asks is_available() itself.
SITECUSTOMIZE = '''
import os
import sys
import torch

def _forbidden(name, original, only_from_tiersep):
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if only_from_tiersep and not caller.startswith("tiersep"):
            return original(*args, **kwargs)
        with open(os.environ["CUDA_TOUCH_LOG"], "a") as log:
            log.write(f"{name} from {caller}\\n")
        raise RuntimeError(f"{name}: this job must not touch CUDA")
    return call

for module, names in ((torch.cuda, ("init", "is_available", "device_count", "mem_get_info", "_lazy_init",
                                    "current_device", "set_device", "get_device_name",
                                    "get_device_properties", "memory_reserved", "synchronize")),
                      (torch._C, ("_cuda_init",))):
    for name in names:
        setattr(module, name, _forbidden(f"{module.__name__}.{name}", getattr(module, name),
                                         name in ("is_available", "device_count")))
'''


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A workspace (tiny config with budget_gib: auto) and an env whose processes cannot touch CUDA."""
    root = tmp_path_factory.mktemp("no_cuda")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cfg = yaml.safe_load(TINY_CONFIG.read_text())
    cfg.update(budget_gib="auto", presets_dir=str(REPO / "tests" / "configs" / "presets"), estimate_tiers=[])
    cfg["data"]["prepared_dir"] = str(root / "data" / "prepared")
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = root / "cuda_touched.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_TOUCH_LOG": str(log), "OMP_NUM_THREADS": "1"}
    return root, env, log


def tiersep(guarded, *args: str) -> subprocess.CompletedProcess:
    root, env, _ = guarded
    return subprocess.run([sys.executable, "-m", "tiersep.cli", *args, "--config", str(root / "config.yaml")],
                          cwd=root, env=env, text=True, capture_output=True, timeout=600)


def test_the_guard_catches_a_cuda_touch(guarded):
    """The guard works, in one process: asking for a context, creating a CUDA tensor and a tiersep
    module asking is_available() are each recorded and refused."""
    root, env, log = guarded
    probe = """
import torch
for module, statement in (("__main__", "torch.cuda.mem_get_info()"),
                          ("__main__", "torch.zeros(1, device='cuda')"),
                          ("tiersep.x", "torch.cuda.is_available()")):   # as if in a tiersep module
    try:
        exec(statement, {"__name__": module, "torch": torch})
        print("allowed", statement)
    except RuntimeError as err:
        print("refused", "must not touch CUDA" in str(err))
"""
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert proc.stdout.split("\n")[:3] == ["refused True"] * 3, (proc.stdout, proc.stderr[-2000:])
    assert log.read_text().splitlines() == ["torch.cuda.mem_get_info from __main__",
                                            "torch.cuda._lazy_init from __main__",
                                            "torch.cuda.is_available from tiersep.x"]
    log.unlink()


@pytest.mark.slow  # five real CLI runs, each importing torch: about 100 s on 2 busy cores
def test_cpu_stages_never_touch_cuda_with_budget_auto(guarded):
    root, _, log = guarded
    results = root / "results"
    steps = [
        ("prepare", "--out", str(root / "data" / "prepared" / "synthetic" / "8000"), "--sample-rate", "8000"),
        # the tiny tier as configured (estimate.device), then as a GPU tier: both are traced on this CPU
        ("estimate", "--preset", "test_tiny", "--out", str(results / "vram" / "test_tiny.json")),
        ("estimate", "--preset", "test_tiny", "--device", "cuda", "--out", str(root / "tiny_cuda.json")),
        ("fit", "--preset", "test_tiny", "--budget", "4", "--device", "cuda", "--out", str(root / "fitted.yaml")),
        ("report", "--results", str(results), "--out", str(results / "report")),
    ]
    for args in steps:
        proc = tiersep(guarded, *args)
        assert proc.returncode == 0, (args[0], proc.stdout[-2000:], proc.stderr[-4000:])
        assert not log.exists(), f"tiersep {args[0]} touched CUDA: {log.read_text().splitlines()}"
    record = json.loads((root / "tiny_cuda.json").read_text())
    # auto is resolved by the train job on its GPU: the estimate gives no verdict and says why
    assert record["budget"] == "auto (checked at train time)"
    assert record["budget_bytes"] is None and record["fits"] is None
    assert (results / "report" / "index.html").is_file()


def test_gpu_info_is_none_without_a_driver():
    """This machine has no NVIDIA driver: NVML is absent and every reading is None, not an error."""
    assert gpu_info.free_bytes() is None
    assert gpu_info.processes() is None
    assert gpu_info.name() is None and gpu_info.driver_version() is None
    assert gpu_info.other_processes_bytes() == 0


def test_gpu_info_reads_nvml(monkeypatch):
    """The NVML calls and their aggregation, against a stand-in pynvml module (no GPU here): two
    entries of one pid are summed, the caller is left out, a hidden usage stays None."""
    proc = types.SimpleNamespace
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetMemoryInfo=lambda handle: proc(free=7 * 2**30, total=80 * 2**30, used=73 * 2**30),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [
            proc(pid=101, usedGpuMemory=2**30), proc(pid=os.getpid(), usedGpuMemory=5 * 2**30),
            proc(pid=202, usedGpuMemory=None)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda handle: [proc(pid=101, usedGpuMemory=2**20)],
        nvmlDeviceGetName=lambda handle: b"NVIDIA H100 80GB HBM3", nvmlSystemGetDriverVersion=lambda: "580.95.05")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert gpu_info.free_bytes() == 7 * 2**30
    found = gpu_info.processes(exclude_pid=os.getpid())
    assert [(p["pid"], p["used_bytes"]) for p in found] == [(101, 2**30 + 2**20), (202, None)]
    assert gpu_info.processes()[0] == {"pid": os.getpid(), "name": gpu_info._process_name(os.getpid()),
                                       "used_bytes": 5 * 2**30}
    assert gpu_info.other_processes_bytes() == 2**30 + 2**20      # the others, hidden usage as 0
    assert (gpu_info.name(), gpu_info.driver_version()) == ("NVIDIA H100 80GB HBM3", "580.95.05")


def test_a_cuda_trace_does_not_ask_the_gpu_about_bf16(monkeypatch):
    """On a machine with a GPU, torch.autocast("cuda", bf16) calls torch.cuda.is_bf16_supported(),
    which starts a CUDA context: on an H200 the search's gate did so in its orchestrator
    (bench/gpu_search_check.py, 2026-11-26). Here, with no GPU, autocast is made to believe one is
    there (amp_definitely_not_available, what it checks first), and the question is refused: the
    bf16 trace must answer it for the GPU it models."""
    import torch
    import torch.cuda.amp.common as amp_common

    from tiersep import config as C
    from tiersep.memory import estimate

    asked = []

    def refuse(*args, **kwargs):
        asked.append(True)
        raise RuntimeError("is_bf16_supported: this estimate must not ask the GPU")

    monkeypatch.setattr(amp_common, "amp_definitely_not_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", refuse)
    preset = C.load_preset(str(REPO / "tests" / "configs" / "presets" / "test_tiny.yaml"))
    preset = C.set_field(preset, "train.precision", "bf16")
    record = estimate(preset, "trace", "cuda")
    assert record["peak_bytes"] > 0 and not asked
    assert torch.cuda.is_bf16_supported is refuse      # put back after the trace
