"""Training-step time and peak memory of tiersep's TF-Locoformer against the reference separator.

    python bench/model_step.py --reference /path/to/tf-locoformer [--reference-deps DIR] [--tiers]

--reference is a checkout of merlresearch/tf-locoformer (a work tree, or the git directory the
`fetch` tool leaves, read with `git show`); it is loaded at run time and never copied into this
repository. Its ESPnet imports are stubbed here (base class, complex helper); its RoPE comes from
rotary-embedding-torch when importable (put it on the path with --reference-deps), else from a stub
built on ours (said in the output).

For two presets shrunk to CPU size (mono, 4 sources, identical dimensions for both) it checks that
the two models compute the same function (weights copied across; eval-mode outputs and gradients),
then times a full training step (forward, loss, backward, AdamW; fp32) and counts the peak bytes of
live tensors during one step (a TorchDispatchMode adding each new storage and subtracting it when
freed; weights and optimizer state made before the step are not counted). Ours runs twice: with
attention_backend auto, and with math, the SDPA kernel the reference's flags select on a CPU.

--tiers also times our step on the real CPU tiers (config/presets/cpu_tiny.yaml, cpu_small.yaml;
stereo, their batch size) for tuning their step counts.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiersep.config import load_preset, validate  # noqa: E402
from tiersep.memory.tracker import StorageTracker  # noqa: E402
from tiersep.model import build_loss, build_model, count_parameters  # noqa: E402
from tiersep.model.tflocoformer import RotaryEmbedding  # noqa: E402
from tiersep.train.step import make_optimizer, train_step  # noqa: E402

SEPARATOR_FILE = "espnet2/enh/separator/tflocoformer_separator.py"
MiB = 2 ** 20


# ----------------------------------------------------------------------------------------------
# peak live tensor bytes


def exact_bytes(nbytes: int) -> int:
    """Count storages at their exact size (no allocator rounding) for a like-for-like comparison."""
    return nbytes


# ----------------------------------------------------------------------------------------------
# the reference, loaded from a checkout with its ESPnet imports stubbed


def reference_source(path: Path) -> str:
    if (path / SEPARATOR_FILE).is_file():
        return (path / SEPARATOR_FILE).read_text()
    result = subprocess.run(["git", f"--git-dir={path}", "show", f"HEAD:{SEPARATOR_FILE}"],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"--reference {path}: neither a work tree with {SEPARATOR_FILE} nor a git directory "
                 f"holding it ({result.stderr.strip()})")
    return result.stdout


class StubRotaryEmbedding(nn.Module):
    """Stands in for rotary_embedding_torch.RotaryEmbedding (same interleaved RoPE, same parameter)."""

    def __init__(self, dim, theta=10000):
        super().__init__()
        self.freqs = nn.Parameter(1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), requires_grad=False)
        self._rope = RotaryEmbedding(dim, theta)

    def rotate_queries_or_keys(self, t):
        return self._rope(t)


def install_stubs(deps: Path | None) -> str:
    """Fake just enough of espnet2 for the separator file to import; say where RoPE comes from."""
    if deps:
        sys.path.insert(0, str(deps))

    class AbsSeparator(nn.Module):
        pass

    modules = {
        "espnet2": {}, "espnet2.enh": {}, "espnet2.enh.layers": {}, "espnet2.enh.separator": {},
        "espnet2.enh.layers.complex_utils": {"new_complex_like": lambda ref, parts: torch.complex(*parts)},
        "espnet2.enh.separator.abs_separator": {"AbsSeparator": AbsSeparator},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    try:
        import rotary_embedding_torch  # noqa: F401
        return f"rotary-embedding-torch from {Path(rotary_embedding_torch.__file__).parent}"
    except ImportError:
        stub = types.ModuleType("rotary_embedding_torch")
        stub.RotaryEmbedding = StubRotaryEmbedding
        sys.modules["rotary_embedding_torch"] = stub
        return "STUB built on tiersep's RotaryEmbedding (rotary-embedding-torch not importable)"


def load_reference(path: Path):
    module = types.ModuleType("reference_tflocoformer_separator")
    exec(compile(reference_source(path), str(path / SEPARATOR_FILE), "exec"), module.__dict__)
    return module.TFLocoformerSeparator


class ReferenceSystem(nn.Module):
    """The reference separator inside the ESPnet recipe's pipeline: normalize_variance, STFT
    encoder, separator, iSTFT decoder. mixture [B, 1, S] -> [B, n_src, 1, S]."""

    def __init__(self, separator: nn.Module, n_fft: int, hop: int):
        super().__init__()
        self.separator, self.n_fft, self.hop = separator, n_fft, hop

    def forward(self, mixture):
        b, _, length = mixture.shape
        scale = mixture.std(dim=(1, 2), keepdim=True).clamp_min(1e-8)
        window = torch.hann_window(self.n_fft, device=mixture.device)
        spec = torch.stft(mixture[:, 0] / scale[:, 0], self.n_fft, self.hop, window=window,
                          center=True, return_complex=True).transpose(1, 2)  # [B, T, F]
        sources, _, _ = self.separator(spec, torch.full((b,), length))
        waves = [torch.istft(s.transpose(1, 2), self.n_fft, self.hop, window=window, length=length)
                 for s in sources]
        return torch.stack(waves, dim=1)[:, :, None] * scale[:, None]


def build_reference(Separator, preset: dict) -> ReferenceSystem:
    m = preset["model"]
    separator = Separator(
        None, num_spk=len(m["sources"]), n_layers=m["n_layers"], emb_dim=m["emb_dim"],
        norm_type="rmsgroupnorm", num_groups=m["norm_groups"], tf_order="ft", n_heads=m["n_heads"],
        flash_attention=False, attention_dim=m["attention_dim"],
        ffn_type=["swiglu_conv1d", "swiglu_conv1d"], ffn_hidden_dim=[m["ffn_hidden"]] * 2,
        conv1d_kernel=m["conv_kernel"], conv1d_shift=m["conv_stride"], dropout=m["dropout"], eps=m["eps"],
    )
    return ReferenceSystem(separator, preset["audio"]["n_fft"], preset["audio"]["hop"])


def reference_name(ours: str) -> str | None:
    """Our parameter name -> the reference's (None for nothing to map)."""
    for a, b in [("encoder.", "separator.conv."), ("decoder.", "separator.deconv.")]:
        if ours.startswith(a):
            return b + ours[len(a):]
    name = "separator." + ours.replace(".time_path.", ".frame_path.")
    for a, b in [("norm_ffn_pre.gain", "ffn_norm.1.gamma"), ("norm_ffn_post.gain", "ffn_norm.0.gamma"),
                 ("norm_attn.gain", "attn_norm.gamma"), ("ffn_pre.conv.", "ffn.1.conv1d."),
                 ("ffn_pre.deconv.", "ffn.1.deconv1d."), ("ffn_post.conv.", "ffn.0.conv1d."),
                 ("ffn_post.deconv.", "ffn.0.deconv1d."), ("attn.to_qkv.", "attn.qkv."),
                 ("attn.to_out.", "attn.aggregate_heads.0.")]:
        name = name.replace(a, b)
    return name


def copy_weights(ours: nn.Module, reference: nn.Module) -> dict[str, str]:
    """Load our weights into the reference; every reference parameter but RoPE's fixed freqs is set."""
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    mapping = {}
    with torch.no_grad():
        for name, param in ours.named_parameters():
            target = reference_name(name)
            if target not in ref_params or ref_params[target].shape != param.shape:
                sys.exit(f"weight mapping: {name} -> {target} not found or of another shape")
            ref_params[target].copy_(param)
            mapping[name] = target
    unset = [n for n in ref_params if n not in mapping.values() and not n.endswith("rope.freqs")]
    if unset:
        sys.exit(f"weight mapping: reference parameters left unset: {unset[:5]}")
    return mapping


def compare(ours: nn.Module, reference: nn.Module, mapping: dict, preset: dict) -> tuple[float, float]:
    """(max |output difference| / max |output|, largest relative gradient difference of a parameter)."""
    ours.eval(), reference.eval()
    torch.manual_seed(1)
    samples = preset["audio"]["segment_samples"]
    mixture = torch.randn(2, 1, samples)
    targets = torch.randn(2, len(preset["model"]["sources"]), 1, samples)
    loss_fn = build_loss(preset)
    outputs = []
    for model in (ours, reference):
        model.zero_grad(set_to_none=True)
        out = model(mixture)
        loss_fn(out, targets).backward()
        outputs.append(out.detach())
    out_diff = ((outputs[0] - outputs[1]).abs().max() / outputs[1].abs().max()).item()
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
    # Per parameter, relative to its largest reference gradient entry; floored at 1e-6 of the largest
    # entry overall, as some gradients (the decoder bias) are ~0 and then all rounding.
    floor = 1e-6 * max(g.abs().max() for g in ref_grads.values())
    grad_diff = max(((p.grad - ref_grads[mapping[n]]).abs().max()
                     / torch.maximum(ref_grads[mapping[n]].abs().max(), floor)).item()
                    for n, p in ours.named_parameters())
    ours.train(), reference.train()
    return out_diff, grad_diff


# ----------------------------------------------------------------------------------------------
# timing


class StepRunner:
    """One model's training step (forward, loss, backward, AdamW) on a fixed random batch."""

    def __init__(self, model: nn.Module, preset: dict, batch_size: int, channels: int):
        torch.manual_seed(0)
        samples = preset["audio"]["segment_samples"]
        n_src = len(preset["model"]["sources"])
        self.batch = [(torch.randn(batch_size, channels, samples),
                       torch.randn(batch_size, n_src, channels, samples))]
        self.model, self.preset = model.train(), preset
        self.loss_fn, self.optimizer = build_loss(preset), make_optimizer(model, preset, "cpu")
        self.step()  # warm-up; creates the AdamW state

    def step(self) -> float:
        start = time.perf_counter()
        train_step(self.model, self.loss_fn, self.optimizer, self.batch, self.preset, "cpu")
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        with StorageTracker(block_bytes=exact_bytes) as tracker:
            self.step()
        return tracker.peak_bytes


def measure(runners: dict[str, StepRunner], steps: int) -> dict[str, dict]:
    """Median step seconds and peak live bytes per runner. Steps go round-robin over the runners so
    that the load of a shared machine weighs on each alike."""
    times = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            times[name].append(runner.step())
    return {name: {"seconds": statistics.median(times[name]), "peak_bytes": runner.peak_bytes()}
            for name, runner in runners.items()}


def shrunk_presets() -> list[tuple[str, dict, int]]:
    """(label, preset, batch size): two tiers cut to CPU size, mono, 4 sources."""
    def make(name, audio, model, dropout):
        raw = {"name": name, "audio": {"channels": 1, **audio},
               "model": {"dropout": dropout, "checkpointing": False, **model},
               "train": {"precision": "fp32"}}
        return validate(raw, "preset.schema.yaml", f"bench preset {name}")

    cpu_small = make("cpu_small_mono",
                     {"sample_rate": 8000, "segment_samples": 16000, "n_fft": 256, "hop": 128},
                     {"n_layers": 2, "emb_dim": 24, "attention_dim": 24, "n_heads": 2, "ffn_hidden": 48}, 0.0)
    small = make("small_8k_1s",
                 {"sample_rate": 8000, "segment_samples": 8000, "n_fft": 256, "hop": 64},
                 {"n_layers": 3, "emb_dim": 48, "attention_dim": 48, "n_heads": 4, "ffn_hidden": 192}, 0.1)
    return [("cpu_small (mono, 2 s @ 8 kHz, n_fft 256/128, 2 x 24, batch 4)", cpu_small, 4),
            ("small shrunk (mono, 1 s @ 8 kHz, n_fft 256/64, 3 x 48, dropout 0.1, batch 1)", small, 1)]


def compare_with_reference(args) -> None:
    rope_from = install_stubs(args.reference_deps)
    Separator = load_reference(args.reference)
    print(f"reference: {args.reference}:{SEPARATOR_FILE}; RoPE: {rope_from}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps each\n")
    for label, preset, batch_size in shrunk_presets():
        torch.manual_seed(0)
        ours = build_model(preset)
        reference = build_reference(Separator, preset)
        mapping = copy_weights(ours, reference)
        out_diff, grad_diff = compare(ours, reference, mapping, preset)
        print(f"== {label}")
        print(f"parameters: ours {count_parameters(ours):,}, reference {count_parameters(reference):,} "
              f"(incl. its RoPE freqs); same function: output rel. diff {out_diff:.1e}, "
              f"gradient rel. diff {grad_diff:.1e}")
        ours_math = copy.deepcopy(ours)
        ours_math.attention_backend = "math"
        rows = measure({"reference": StepRunner(reference, preset, batch_size, 1),
                        "ours (auto)": StepRunner(ours, preset, batch_size, 1),
                        "ours (math)": StepRunner(ours_math, preset, batch_size, 1)}, args.steps)
        ref = rows["reference"]
        print(f"{'':14} {'step s':>8} {'peak MiB':>9} {'time/ref':>9} {'peak/ref':>9}")
        for name, row in rows.items():
            print(f"{name:14} {row['seconds']:8.3f} {row['peak_bytes'] / MiB:9.1f} "
                  f"{row['seconds'] / ref['seconds']:9.2f} {row['peak_bytes'] / ref['peak_bytes']:9.2f}")
        print()


def time_cpu_tiers(args) -> None:
    print("== our training step on the CPU tiers (stereo, preset batch size, fp32, AdamW)")
    print(f"{'preset':10} {'params':>8} {'batch':>5} {'step s':>8} {'peak MiB':>9}")
    for name in ("cpu_tiny", "cpu_small"):
        preset = load_preset(str(ROOT / "config" / "presets" / f"{name}.yaml"))
        preset = copy.deepcopy(preset)
        preset["train"]["precision"] = "fp32"
        torch.manual_seed(0)
        model = build_model(preset)
        runner = StepRunner(model, preset, preset["train"]["batch_size"], preset["audio"]["channels"])
        row = measure({name: runner}, args.steps)[name]
        print(f"{name:10} {count_parameters(model):8,} {preset['train']['batch_size']:5} "
              f"{row['seconds']:8.3f} {row['peak_bytes'] / MiB:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="tf-locoformer checkout (work tree or git dir)")
    parser.add_argument("--reference-deps", type=Path, help="folder holding rotary_embedding_torch, einops")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median)")
    parser.add_argument("--tiers", action="store_true", help="also time our step on cpu_tiny and cpu_small")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: steadiest on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.reference and not args.tiers:
        parser.error("give --reference PATH and/or --tiers")
    if args.reference:
        compare_with_reference(args)
    if args.tiers:
        time_cpu_tiers(args)


if __name__ == "__main__":
    main()
