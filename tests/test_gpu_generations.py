"""Issue 31: estimates and fits by GPU generation. The card decides the SDPA kernel (no flash
before sm80; below it the fused kernels take fp16 but not bf16) and what `auto` precision means
(bf16 where native, else fp16); a precision or kernel a card cannot run is refused in one line that
names it; an sm80+ card traces exactly the preset it did before the catalogue; the records name the
card, and a generation without GPU evidence books the conservative figure. Through the real CLI:
`tiersep estimate --gpu` and `tiersep fit --gpus t4` on the seed tiers. No GPU runs here: the
cards are modelled (their kernels from sdp_utils.cpp, tiersep.gpu_catalogue)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiersep import config as C
from tiersep import gpu_catalogue
from tiersep.config import ConfigError
from tiersep.memory import accuracy
from tiersep.memory.conditions import decide
from tiersep.model.step import resolve_precision

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")
SEEDS = ["ultra_safe", "small", "memory_optimized", "large", "xlarge"]
CARDS = gpu_catalogue.by_name()
# one card per generation, and what runs there, written out (not derived): (precision, kernel) for
# ultra_safe (head dim 24) with train.precision auto, then with fp32
BY_GENERATION = {
    "p100": ("Pascal", ("fp16", "efficient"), ("fp32", "efficient")),
    "v100-16gb": ("Volta", ("fp16", "efficient"), ("fp32", "efficient")),
    "t4": ("Turing", ("fp16", "efficient"), ("fp32", "efficient")),
    "a100-40gb": ("Ampere", ("bf16", "flash"), ("fp32", "efficient")),
    "rtx3090": ("Ampere", ("bf16", "flash"), ("fp32", "efficient")),
    "l4": ("Ada", ("bf16", "flash"), ("fp32", "efficient")),
    "h100": ("Hopper", ("bf16", "flash"), ("fp32", "efficient")),
    "b200": ("Blackwell", ("bf16", "flash"), ("fp32", "efficient")),
}


def seed(name: str, **fields) -> dict:
    preset = C.load_preset(name)
    for key, value in fields.items():
        preset = C.set_field(preset, key, value)
    return preset


@pytest.mark.parametrize("card", BY_GENERATION)
def test_each_generation_runs_its_own_kernel_for_a_16_bit_and_an_fp32_preset(card):
    generation, half, fp32 = BY_GENERATION[card]
    entry = CARDS[card]
    assert entry.generation == generation
    for precision, expected in (("auto", half), ("fp32", fp32)):
        cond = decide(seed("ultra_safe", **{"train.precision": precision}), "cuda", gpu=entry)
        assert (cond.precision, cond.attention) == expected, (card, precision)


def test_a_head_dim_the_efficient_kernel_refuses_in_16_bit_falls_to_math_on_a_t4():
    """small's head dim is 12: the efficient kernel wants a multiple of 8 in fp16, 4 in fp32."""
    t4 = CARDS["t4"]
    assert decide(seed("small", **{"train.precision": "fp16"}), "cuda", gpu=t4).attention == "math"
    assert decide(seed("small", **{"train.precision": "fp32"}), "cuda", gpu=t4).attention == "efficient"
    assert decide(seed("small"), "cuda", gpu=CARDS["h100"]).attention == "flash"


@pytest.mark.parametrize("name", SEEDS + ["cpu_tiny", "cpu_small"])
def test_a_t4_never_gets_flash_or_bf16(name):
    t4 = CARDS["t4"]
    for precision in ("fp32", "fp16", "auto"):
        for backend in ("auto", "efficient", "math"):
            try:
                cond = decide(seed(name, **{"train.precision": precision, "model.attention_backend": backend}),
                              "cuda", gpu=t4)
            except ConfigError as err:     # efficient asked for with a head dim it cannot take
                assert backend == "efficient" and "head dim" in str(err)
                continue
            assert cond.attention != "flash" and cond.precision != "bf16", (precision, backend)
    with pytest.raises(ConfigError, match=r"^train.precision: bf16 is not native on the T4 \(sm75, Turing\)"):
        decide(seed(name, **{"train.precision": "bf16"}), "cuda", gpu=t4)
    with pytest.raises(ConfigError, match=r"^model.attention_backend: flash does not run on the T4 \(sm75, Turing\)"):
        decide(seed(name, **{"train.precision": "fp16", "model.attention_backend": "flash"}), "cuda", gpu=t4)


def test_auto_precision_per_device():
    assert [resolve_precision("auto", d, b) for d, b in (("cuda", True), ("cuda", False), ("cpu", True))] == \
        ["bf16", "fp16", "fp32"]
    assert resolve_precision("fp16", "cuda", True) == "fp16"
    assert decide(seed("cpu_tiny", **{"train.precision": "auto"}), "cpu").precision == "fp32"


@pytest.mark.parametrize("card", [e.name for e in gpu_catalogue.CATALOGUE if e.capability >= (8, 0)])
def test_an_sm80_card_traces_the_preset_as_given_but_where_torch_would_not_try_cudnn(card):
    """What keeps every Hopper accuracy figure as it was: on a card with flash and bf16 the estimate
    traces the preset as given (Conditions.applied changes nothing but an auto precision), and the
    trace's `auto` runs cuDNN attention for an unpadded 16-bit head dim, as the H100 and H200 did.
    torch 2.11 tries cuDNN first only on sm90, sm100 and sm103 (check_prefer_cudnn_attention): on
    Ampere and Ada, auto runs flash there, so the preset is traced with attention_backend flash
    (FA2's backward buffers). Head dims: small 12 (padded: flash everywhere), the others 16 or 24."""
    entry = CARDS[card]
    assert entry.prefers_cudnn == (entry.capability in ((9, 0), (10, 0), (10, 3)))
    restated = []
    for name in SEEDS:
        for precision in ("fp32", "bf16", "fp16"):
            preset = seed(name, **{"train.precision": precision})
            cond = decide(preset, "cuda", gpu=entry)
            assert cond.attention == decide(preset, "cuda").attention      # None: any sm80+ card, as before
            applied = cond.applied(preset)
            head_dim = preset["model"]["attention_dim"] // preset["model"]["n_heads"]
            if entry.prefers_cudnn or cond.attention != "flash" or head_dim % 8:
                assert applied is preset, (name, precision)
            else:
                assert applied["model"]["attention_backend"] == "flash" and applied["train"] == preset["train"]
                restated.append((name, precision))
    if not entry.prefers_cudnn:   # every seed tier but small, in both 16-bit types
        assert sorted(restated) == sorted((n, p) for n in SEEDS if n != "small" for p in ("bf16", "fp16")), restated


@pytest.mark.parametrize("cudnn, switch, first", [
    (91900, None, True),     # this project's torch 2.11 cu130 wheel: cuDNN 9.19
    (91501, None, True),     # 9.15.1, the first that check_prefer_cudnn_attention takes
    (91500, None, False),    # 9.15.0 and older: a CUDA 12.x wheel's cuDNN
    (None, None, True),      # a CPU-only torch, planning for a GPU: the cu130 wheels' answer
    (0, None, False),        # a cuDNN torch cannot read (_runtime_cudnn): no cuDNN attention either
    (91900, "1", False),     # TORCH_CUDNN_SDPA_DEPRIORITIZED=1
    (91900, "0", True),
])
def test_hopper_traces_flash_where_this_torch_would_not_try_cudnn_first(monkeypatch, cudnn, switch, first):
    """check_prefer_cudnn_attention's software half (torch 2.11's sdp_utils.cpp: a runtime cuDNN above
    91500 and the TORCH_CUDNN_SDPA_DEPRIORITIZED switch not 1): where it says no, an H100 runs flash,
    as an Ampere card does, so the estimate traces flash (FA2's buffers) and names it."""
    monkeypatch.setattr(gpu_catalogue, "_runtime_cudnn", lambda: cudnn)
    if switch is None:
        monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", switch)
    h100, a100 = CARDS["h100"], CARDS["a100-40gb"]
    assert gpu_catalogue.cudnn_attention_first() is first and h100.prefers_cudnn is first
    assert not a100.prefers_cudnn                                     # Ampere: flash first whatever the cuDNN
    preset = seed("ultra_safe", **{"train.precision": "bf16"})        # head dim 24: cuDNN takes it
    cond = decide(preset, "cuda", gpu=h100)
    applied = cond.applied(preset)
    assert (applied is preset) is first
    assert applied["model"]["attention_backend"] == ("auto" if first else "flash")
    assert cond.traced_kernel(applied) == ("cudnn" if first else "flash")
    note = cond.gpu_record()["note"]                                  # the record says why
    assert note is None if first else "does not try cuDNN attention first" in note, note
    why = {0: "its cuDNN cannot be read", 91500: "its cuDNN 91500 is not above 91500"}.get(cudnn, "")
    assert first or why in note, note
    assert decide(preset, "cuda", gpu=a100).gpu_record()["note"] is None


def test_the_deprioritizing_switch_reaches_the_estimate_through_the_cli(tmp_path):
    """The same switch in a real `tiersep estimate --gpu h100`: the record names flash, its trace ran
    FA2's backward (two buffers per call, softmax_d and dq_accum, where cuDNN allocates one workspace:
    more events), and its uncertainty is the Hopper flash class's, not the cuDNN class's."""
    records = {}
    for switch in ("0", "1"):
        out = tmp_path / f"h100-{switch}.json"
        done = subprocess.run([TIERSEP, "estimate", "--config", "config/config.yaml", "--preset", "ultra_safe",
                               "--set", "train.precision=bf16", "--gpu", "h100", "--out", str(out)],
                              cwd=REPO, text=True, capture_output=True, timeout=600,
                              env={**os.environ, "TORCH_CUDNN_SDPA_DEPRIORITIZED": switch})
        assert done.returncode == 0, done.stderr[-2000:]
        records[switch] = json.loads(out.read_text())
    assert (records["0"]["attention_backend"], records["1"]["attention_backend"]) == ("cudnn", "flash")
    assert records["1"]["events"] > records["0"]["events"]
    assert [r["uncertainty_class"]["attention"] for r in records.values()] == ["cudnn", "flash"]
    assert records["0"]["gpu"]["note"] is None
    assert "(TORCH_CUDNN_SDPA_DEPRIORITIZED=1)" in records["1"]["gpu"]["note"]


def test_estimate_gpu_through_the_cli(tmp_path):
    """--gpu t4: fp16 and the efficient kernel for ultra_safe at auto precision, judged against the
    T4's 16 GB, the record naming the card and booking 10% (no Turing evidence); bf16 on a T4 and flash
    on a V100 are refused in one line naming the card."""
    out = tmp_path / "t4.json"
    done = subprocess.run([TIERSEP, "estimate", "--config", "config/config.yaml", "--preset", "ultra_safe",
                           "--set", "train.precision=auto", "--gpu", "t4", "--out", str(out)],
                          cwd=REPO, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(trace, cuda, T4, fp16, efficient attention)" in done.stdout
    record = json.loads(out.read_text())
    assert (record["precision"], record["attention_backend"], record["gpu"]["name"], record["gpu"]["generation"]) == \
        ("fp16", "efficient", "t4", "Turing")
    assert record["budget_bytes"] == 16 * 10**9 and record["uncertainty"] == accuracy.NO_EVIDENCE_UNCERTAINTY
    assert "Turing" in record["uncertainty_evidence"] and "conservatively" in record["uncertainty_evidence"]
    for argv, line in (
            (["--gpu", "t4"], "tiersep estimate: error: train.precision: bf16 is not native on the T4 (sm75, Turing)"),
            (["--gpu", "v100-16gb", "--set", "train.precision=fp16", "--set", "model.attention_backend=flash"],
             "tiersep estimate: error: model.attention_backend: flash does not run on the V100 16GB (sm70, Volta)"),
            (["--gpu", "k80"], "tiersep estimate: error: --gpu: 'k80' is not a GPU of the catalogue")):
        done = subprocess.run([TIERSEP, "estimate", "--config", "config/config.yaml", "--preset", "ultra_safe",
                               *argv, "--out", str(tmp_path / "x.json")],
                              cwd=REPO, text=True, capture_output=True, timeout=600)
        assert done.returncode == 2 and done.stderr.strip().startswith(line), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x.json").exists()


def test_separation_estimate_models_the_card_too(tmp_path):
    """`estimate --inference --gpu t4`: separation on a T4 runs fp16 (auto) on the efficient kernel,
    judged against its 16 GB, the record naming the card; on an H100 the same preset runs bf16 on
    flash. bf16 on a T4 is refused in one line, as for training."""
    out = tmp_path / "t4_sep.json"
    done = subprocess.run([TIERSEP, "estimate", "--config", "config/config.yaml", "--preset", "ultra_safe",
                           "--set", "train.precision=auto", "--inference", "--chunk", "3", "--gpu", "t4",
                           "--out", str(out)], cwd=REPO, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(cuda, T4, fp16, efficient attention)" in done.stdout
    record = json.loads(out.read_text())
    assert (record["mode"], record["precision"], record["attention_backend"], record["gpu"]["name"]) == \
        ("inference", "fp16", "efficient", "t4")
    assert record["budget_bytes"] == 16 * 10**9 and record["fits"] is True

    from tiersep.memory.inference import estimate_inference
    chunk = 3 * 44100
    h100 = estimate_inference(seed("ultra_safe", **{"train.precision": "auto"}), "cuda", chunk, 1, gpu=CARDS["h100"])
    # head dim 16 in bf16: cuDNN attention, which torch tries first on Hopper (bench/results/sdpa_kernels_h200.md)
    assert (h100["precision"], h100["attention_backend"], h100["gpu"]["name"]) == ("bf16", "cudnn", "h100")
    with pytest.raises(ConfigError, match=r"^train.precision: bf16 is not native on the T4 \(sm75, Turing\)"):
        estimate_inference(seed("ultra_safe"), "cuda", chunk, 1, gpu=CARDS["t4"])


def test_fit_the_seed_tiers_to_a_t4_through_the_cli(tmp_path):
    """The bf16 seed tiers become fp16 (no native bf16 on a T4) with the efficient kernel where
    their head dim allows it (math where not: small's 12), large stays fp32 on the efficient
    kernel; every cell names the T4's class, booked at 10%."""
    done = subprocess.run([TIERSEP, "fit", "--config", "config/config.yaml", "--device", "cuda",
                           *[a for p in SEEDS for a in ("--preset", p)], "--gpus", "t4", "--jobs", "2",
                           "--json", str(tmp_path / "m.json"), "--out", str(tmp_path / "presets")],
                          cwd=REPO, text=True, capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "m.json").read_text())
    cells = {row["tier"]: row["cells"][0] for row in record["tiers"]}
    fitting = {tier: cell for tier, cell in cells.items() if cell["status"] != "no"}
    assert {"ultra_safe", "small"} <= set(fitting), {t: c["reason"] for t, c in cells.items()}
    for tier, cell in fitting.items():
        assert cell["gpu"] == "T4" and cell["precision"] in ("fp16", "fp32"), tier
        assert cell["attention_backend"] != "flash" and "Turing" in cell["uncertainty_class"], tier
        assert cell["uncertainty"] == accuracy.NO_EVIDENCE_UNCERTAINTY, tier
        preset = C.load_preset(str(tmp_path / "presets" / f"{cell['preset']}.yaml"))
        assert preset["train"]["precision"] == cell["precision"], tier
        if C.load_preset(tier)["train"]["precision"] == "bf16":
            assert cell["precision"] == "fp16" and "precision" in cell["levers"], tier
            assert any(c.startswith("train.precision: bf16 -> fp16") and "T4 (sm75) has no native bf16" in c
                       for c in cell["changes"]), cell["changes"]
    assert fitting["ultra_safe"]["attention_backend"] == "efficient"
    assert fitting["small"]["attention_backend"] == "math"
    assert any("attention runs efficient on the T4" in c for c in fitting["ultra_safe"]["changes"])


def test_auto_runs_the_kernel_torch_chose_on_the_h200():
    """The trace's `auto` against torch's own choice on an H200 (bench/sdpa_kernels.py, run there:
    `torch._fused_sdp_choice` and the profiler's kernels, 42 dtype x head-dim cells): cuDNN for an
    unpadded 16-bit head dim up to 256, flash for 12, the memory-efficient kernel above 256 and in fp32."""
    import re

    import torch

    from tiersep.memory.trace.attention import auto_kernel

    table = (Path(__file__).resolve().parents[1] / "bench" / "results" / "sdpa_kernels_h200.md").read_text()
    rows = re.findall(r"^\| (bf16|fp16|fp32) \| (\d+) \| (\w+) \| (\w+) \|", table, re.M)
    assert len(rows) == 42
    h200 = CARDS["h200"]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for dtype, head_dim, chosen, seen in rows:
        rule = auto_kernel(dtypes[dtype], int(head_dim), h200)
        assert chosen.startswith(rule) and seen == rule, (dtype, head_dim, chosen, seen, rule)
