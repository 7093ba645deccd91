"""The `analytic` method: a closed form of the peak, calibrated against `trace`, instant.

peak = weights + optimizer state (+ gradients when accumulating) + input batch
       + sum_k c_k * f_k(preset)                       (activations and transients at the peak)
       [cuda: + cuBLAS workspace, + allocator cache (1.2% + min(15%, 96 MiB)), + CUDA context]

The features f_k count elements of the tensors that scale together (B batch, T frames, F frequency
bins, L layers, E emb_dim, H ffn_hidden, A attention_dim, h heads, S samples, n sources, C channels):
  blk_E, blk_H, blk_A = B*T*F*L*{E, H, A}   saved per block per TF bin (residuals, norms, FFN, q/k/v)
  blk_scores         = B*L*h*(T*F^2 + F*T^2)  the math kernel's score matrices (math only)
  scores_max         = B*h*max(T*F^2, F*T^2)  the largest one, held a few times over in its backward
  one_H, one_A, one_scores = the same for ONE block (what checkpointing recomputes; its E-sized
                       part is in io_E)
  io_E = B*T*F*E, spec = B*T*F*n*C, wave = B*S*n*C   encoder/decoder, spectra, waveforms and loss
  blk_pad / one_pad   = the head-dim padding flash copies in (CUDA pads head dims to a multiple of 8)
The coefficients c_k (bytes per element) depend on the device, precision, checkpointing, attention
kernel and whether dropout is on (its masks), so they are fitted per such *mode*, by non-negative
least squares (relative error) over traces of small configurations: `calibrate()` writes them to
analytic_calibration.json next to this file; `python -m tiersep.memory.analytic` re-runs it after
the model changes (a test checks the fit is still within 10% of trace).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .calibration import resolve as resolve_device_calibration
from .constants import BREAKDOWN_KEYS
from .conditions import Conditions, decide
from .trace import cpu_block_bytes, cuda_block_bytes

CALIBRATION_FILE = Path(__file__).with_name("analytic_calibration.json")
UNCERTAINTY = 0.10
# Reserved vs allocated at the peak (the allocator's cache beyond the live tensors): the traces'
# allocator model gives +1.2% on the seed presets, and up to +15% (at most ~100 MiB) for steps of
# small tensors, whose 1-10 MiB requests each take a 20 MiB segment.
RESERVED_FACTOR = 1.012
RESERVED_SMALL = 0.15
RESERVED_EXTRA = 96 * 2**20


def frames_and_bins(preset: dict) -> tuple[int, int]:
    a = preset["audio"]
    return 1 + a["segment_samples"] // a["hop"], a["n_fft"] // 2 + 1


def kernel_class(cond: Conditions) -> str:
    """Attention kernel family of the mode: 'math' (O(L^2) scores) or 'fused' (O(L) state)."""
    return "math" if cond.attention == "math" else "fused"


def mode_of(preset: dict, cond: Conditions) -> str:
    m, t = preset["model"], preset["train"]
    # fp16 is fitted as bf16: both 2 bytes, the same ops lowered, so the trace's bytes are the same
    precision = "bf16" if t["precision"] == "fp16" else t["precision"]
    return "/".join([cond.device, precision, "ckpt" if m["checkpointing"] else "full",
                     kernel_class(cond), "drop" if m["dropout"] > 0 else "nodrop"])


def padded_attention_dim(preset: dict, cond: Conditions) -> int:
    """attention_dim as the flash kernel sees it: CUDA pads the head dim to a multiple of 8."""
    m = preset["model"]
    if cond.device == "cuda" and cond.attention == "flash":
        return m["n_heads"] * -(-(m["attention_dim"] // m["n_heads"]) // 8) * 8
    return m["attention_dim"]


def features(preset: dict, cond: Conditions) -> dict[str, float]:
    a, m, t = preset["audio"], preset["model"], preset["train"]
    T, F = frames_and_bins(preset)
    B, L, E, H, A, h = t["batch_size"], m["n_layers"], m["emb_dim"], m["ffn_hidden"], m["attention_dim"], m["n_heads"]
    n, C, S = len(m["sources"]), a["channels"], a["segment_samples"]
    bins = B * T * F
    scores = B * h * (T * F * F + F * T * T)
    pad = padded_attention_dim(preset, cond) - A   # extra head-dim columns flash copies in
    f = {"io_E": bins * E, "spec": bins * n * C, "wave": B * S * n * C}
    math_kernel = kernel_class(cond) == "math"
    if math_kernel:   # the backward of one attention call holds a few of its score matrices at once
        f["scores_max"] = B * h * max(T * F * F, F * T * T)
    if m["checkpointing"]:   # saved: each block's input; recomputed: one block at a time
        f.update(blk_E=bins * L * E, one_H=bins * H, one_A=bins * A, one_pad=bins * pad)
        if math_kernel:
            f["one_scores"] = scores
    else:
        f.update(blk_E=bins * L * E, blk_H=bins * L * H, blk_A=bins * L * A, blk_pad=bins * L * pad)
        if math_kernel:
            f["blk_scores"] = scores * L
    return {k: float(v) for k, v in f.items()}


def parameter_numels(preset: dict) -> list[int]:
    """Element counts of the model's parameter tensors (built on the meta device: no memory)."""
    from tiersep.model import build_model

    with torch.device("meta"):
        model = build_model(preset)
    return [p.numel() for p in model.parameters()]


def weight_bytes(preset: dict, device: str, numels: list[int] | None = None) -> int:
    """One fp32 copy of the weights, per tensor as the allocator books them (the gradients and
    train.ema's copy are as large)."""
    block = cuda_block_bytes if device == "cuda" else cpu_block_bytes
    numels = numels if numels is not None else parameter_numels(preset)
    return sum(block(4 * n) for n in numels)


def static_bytes(preset: dict, device: str, numels: list[int] | None = None) -> dict[str, int]:
    """Weights (and their EMA copy, train.ema), gradients and AdamW state (exp_avg, exp_avg_sq), per
    tensor as the allocator books them."""
    weights = weight_bytes(preset, device, numels)
    copies = 2 if preset["train"].get("ema") else 1
    return {"weights": copies * weights, "gradients": weights, "optimizer": 2 * weights}


def input_bytes(preset: dict, device: str) -> int:
    a, t = preset["audio"], preset["train"]
    block = cuda_block_bytes if device == "cuda" else cpu_block_bytes
    per = t["batch_size"] * a["channels"] * a["segment_samples"] * 4
    return t["grad_accum"] * (block(per) + block(per * len(preset["model"]["sources"])))


def largest_allocation(preset: dict, cond: Conditions) -> int:
    """Largest single tensor among the usual suspects: math scores, FFN conv output, q/k/v, spectra."""
    a, m, t = preset["audio"], preset["model"], preset["train"]
    T, F = frames_and_bins(preset)
    B = t["batch_size"]
    act = 4 if t["precision"] == "fp32" else 2
    candidates = [B * T * F * 2 * m["ffn_hidden"] * act, B * T * F * 3 * m["attention_dim"] * act,
                  B * T * F * m["emb_dim"] * 4,
                  B * len(m["sources"]) * a["channels"] * T * F * 8]
    if kernel_class(cond) == "math":
        chunk = m["attention_chunk"]
        # math upcasts to fp32; one call covers at most `chunk` sequences
        candidates += [min(B * T, chunk) * m["n_heads"] * F * F * 4, min(B * F, chunk) * m["n_heads"] * T * T * 4]
    block = cuda_block_bytes if cond.device == "cuda" else cpu_block_bytes
    return block(max(candidates))


def load_calibration() -> dict:
    if not CALIBRATION_FILE.is_file():
        raise FileNotFoundError(f"{CALIBRATION_FILE}: no analytic calibration; run "
                                "`python -m tiersep.memory.analytic` (traces small configurations)")
    return json.loads(CALIBRATION_FILE.read_text())


def activation_bytes(preset: dict, cond: Conditions, calibration: dict | None = None) -> int:
    calibration = calibration or load_calibration()
    mode = mode_of(preset, cond)
    coef = calibration["modes"].get(mode)
    if coef is None:
        raise KeyError(f"analytic: mode {mode} is not calibrated (known: {', '.join(sorted(calibration['modes']))})")
    return int(sum(coef["coef"].get(k, 0.0) * v for k, v in features(preset, cond).items()))


def predict(preset: dict, cond: Conditions, calibration: dict | None = None, numels: list[int] | None = None,
            device_cal: dict | None = None) -> dict:
    """Allocated/reserved/peak bytes and the breakdown, in closed form. `calibration`: this module's
    fitted coefficients; `device_cal`: the GPU's context and workspace (memory.calibration)."""
    static = static_bytes(preset, cond.device, numels)
    if preset["train"]["grad_accum"] == 1:
        static["gradients"] = 0   # the peak comes before most gradients exist
    inputs = input_bytes(preset, cond.device)
    act = max(activation_bytes(preset, cond, calibration), 0)
    live = sum(static.values()) + inputs + act
    if cond.device == "cuda":
        cal = device_cal or resolve_device_calibration("auto")
        allocated = live + cal["cublas_workspace_bytes"]
        reserved = int(allocated * RESERVED_FACTOR + min(RESERVED_SMALL * allocated, RESERVED_EXTRA))
        peak = reserved + cal["context_bytes"]
    else:
        allocated, reserved, peak = live, None, live
    breakdown = {**static, "activations": inputs + act, "transient": 0, "overhead": peak - live}
    return {"allocated": allocated, "reserved": reserved, "peak": peak, "breakdown": breakdown}


def estimate_analytic(preset: dict, cond: Conditions, device_cal: dict | None = None) -> dict:
    """The estimate record fields for method analytic (see estimate.estimate), under its conditions."""
    numels = parameter_numels(preset)
    p = predict(preset, cond, numels=numels, device_cal=device_cal)
    mode = mode_of(preset, cond)
    return {
        "parameters": sum(numels),
        "peak_bytes": int(p["peak"]),
        "largest_allocation_bytes": largest_allocation(preset, cond),
        "breakdown": {k: int(p["breakdown"][k]) for k in BREAKDOWN_KEYS},
        "attention_backend": cond.attention,
        # at least 10%; more where the mode's fit to its calibration traces was looser
        "uncertainty": round(max(UNCERTAINTY, load_calibration()["modes"][mode]["max_rel_err"] + 0.03), 3),
        "allocated_peak_bytes": int(p["allocated"]),
        "reserved_peak_bytes": p["reserved"],
        "mode": mode,
        "notes": ["analytic: activations include the input batch and the transients at the peak"],
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------------------------
# calibration
# ------------------------------------------------------------------------------------------------
# (emb, ffn hidden, attention dim, heads, layers, batch, n_fft, segment samples); hop = n_fft / 4.
# Small enough to trace in about a second, big enough that tensors dwarf the 512-B block rounding.
# (emb, ffn hidden, attention dim, heads, layers, batch, n_fft, hop, segment samples, sample rate).
# Fake tensors cost nothing, so the sizes span what is used: CPU-bench scale (8 kHz, tens of
# channels) up to the seed presets' (44.1 kHz, n_fft 4096, 256 channels, 15 s); a trace costs the
# same whatever the sizes (it scales with the number of ops: layers). Hops of n_fft/2, /4 and /8
# keep spectra and waveforms from being collinear; head dims 4 to 32 (flash pads to 8).
CALIBRATION_CONFIGS = [
    (16, 32, 16, 2, 1, 1, 64, 16, 1024, 8000), (16, 32, 16, 2, 2, 1, 64, 16, 1024, 8000),
    (24, 32, 16, 2, 2, 2, 64, 16, 1024, 8000), (16, 64, 32, 4, 2, 1, 128, 32, 2048, 8000),
    (32, 64, 32, 4, 3, 1, 128, 32, 1536, 8000), (8, 48, 24, 2, 3, 2, 96, 24, 1200, 8000),
    (24, 48, 48, 4, 2, 1, 128, 64, 4096, 8000), (16, 64, 32, 2, 2, 2, 64, 8, 768, 8000),
    (48, 192, 48, 4, 2, 1, 1024, 256, 88200, 44100), (96, 384, 96, 4, 2, 1, 2048, 512, 132300, 44100),
    (128, 512, 128, 8, 2, 1, 2048, 512, 220500, 44100), (192, 768, 192, 12, 2, 1, 4096, 1024, 441000, 44100),
    (256, 1024, 256, 16, 1, 2, 4096, 1024, 661500, 44100), (64, 256, 64, 4, 3, 2, 1024, 256, 44100, 44100),
    (128, 256, 64, 2, 1, 4, 512, 128, 22050, 44100), (96, 768, 192, 8, 2, 1, 2048, 1024, 176400, 44100),
    (160, 640, 160, 10, 1, 1, 4096, 512, 300000, 44100), (32, 128, 32, 4, 4, 8, 512, 128, 16000, 16000),
]


def calibration_preset(config, mode: str) -> dict:
    from tiersep import config as C

    device, precision, ckpt, kernel, drop = mode.split("/")
    E, H, A, h, L, B, n_fft, hop, S, rate = config
    preset = {
        "name": "calibration",
        "audio": {"sample_rate": rate, "segment_samples": S, "n_fft": n_fft, "hop": hop},
        "model": {"n_layers": L, "emb_dim": E, "attention_dim": A, "n_heads": h, "ffn_hidden": H,
                  "norm_groups": 4 if E % 4 == 0 else 1, "dropout": 0.1 if drop == "drop" else 0.0,
                  "attention_backend": "math" if kernel == "math" else "auto",
                  "checkpointing": ckpt == "ckpt"},
        "train": {"batch_size": B, "grad_accum": 1, "precision": precision},
    }
    return C.validate(preset, "preset.schema.yaml", "calibration")


def all_modes() -> list[str]:
    modes = []
    for device in ("cuda", "cpu"):
        for precision in ("fp32", "bf16"):
            for ckpt in ("full", "ckpt"):
                for kernel, drop in (("fused", "nodrop"), ("fused", "drop"), ("math", "nodrop"), ("math", "drop")):
                    if device == "cpu" and kernel == "fused" and drop == "drop":
                        continue   # CPU's flash kernel takes no dropout: auto is math there
                    modes.append("/".join([device, precision, ckpt, kernel, drop]))
    return modes


def fit_mode(mode: str, progress=None) -> dict:
    """Trace the calibration configs in `mode` and fit its coefficients (relative least squares)."""
    import numpy as np

    from .trace import trace_step

    device = mode.split("/")[0]
    rows, targets, names = [], [], None
    for config in CALIBRATION_CONFIGS:
        preset = calibration_preset(config, mode)
        cond = decide(preset, device)
        if mode_of(preset, cond) != mode:
            raise RuntimeError(f"calibration config {config} lands in {mode_of(preset, cond)}, not {mode}")
        r = trace_step(preset, device)
        b = r.breakdown
        target = b["activations"] + b["transient"] + b["gradients"] - r.inputs_bytes
        f = features(preset, cond)
        names = names or sorted(f)
        rows.append([f[k] for k in names])
        targets.append(target)
        if progress:
            progress()
    from scipy.optimize import nnls

    X, y = np.array(rows), np.array(targets, dtype=float)
    w = 1.0 / y   # relative error; non-negative bytes per element keep the form physical
    coef, _ = nnls(X * w[:, None], y * w)
    rel = (X @ coef - y) / y
    return {"coef": dict(zip(names, map(float, coef))), "configs": len(y),
            "max_rel_err": float(np.abs(rel).max())}


def calibrate(modes: list[str] | None = None, path: Path = CALIBRATION_FILE) -> dict:
    from tqdm import tqdm

    from tiersep.io import write_json

    modes = modes or all_modes()
    old = json.loads(path.read_text()) if path.is_file() else {"modes": {}}
    result = {"torch": torch.__version__, "configs": CALIBRATION_CONFIGS, "modes": dict(old.get("modes", {}))}
    with tqdm(total=len(modes) * len(CALIBRATION_CONFIGS), desc="calibrating analytic", unit="trace") as bar:
        for mode in modes:
            result["modes"][mode] = fit_mode(mode, progress=bar.update)
            write_json(path, result)   # keep what is done if interrupted
    return result


if __name__ == "__main__":
    import sys

    fitted = calibrate(sys.argv[1:] or None)
    worst = max(fitted["modes"].items(), key=lambda kv: kv[1]["max_rel_err"])
    print(f"calibrated {len(fitted['modes'])} modes; worst in-sample error {worst[1]['max_rel_err']:.1%} ({worst[0]})")
