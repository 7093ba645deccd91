"""Training-step time and peak memory of tiersep's TF-Locoformer, eager and compiled, against the
reference separator.

    python bench/model_step.py --tiers [--compile] [--device cpu|cuda]
    python bench/model_step.py --reference /path/to/tf-locoformer [--reference-deps DIR] [--compile]
    python bench/model_step.py --saved

--reference is a checkout of merlresearch/tf-locoformer (a work tree, or the git directory the
`fetch` tool leaves, read with `git show`); it is loaded at run time and never copied into this
repository. Its ESPnet imports are stubbed here (base class, complex helper); its RoPE comes from
rotary-embedding-torch when importable (put it on the path with --reference-deps), else from a stub
built on ours (said in the output; the RoPE is then not checked against the reference).

For two presets shrunk to CPU size (mono, 4 sources, identical dimensions for both) it checks that
the two models compute the same function (weights copied across; eval-mode outputs and gradients),
then times a full training step (forward, loss, backward, AdamW; fp32). Ours runs with
attention_backend auto and with math (the SDPA kernel the reference's flags select on a CPU).

With --compile, our model and the reference each run eagerly and under torch.compile.

--tiers times our step on the real CPU tiers (config/presets/cpu_tiny.yaml, cpu_small.yaml; stereo,
their batch size). --compile adds our model under torch.compile (inductor, fullgraph, through
tiersep.model.compile.compile_model); the loss and AdamW stay eager, as in training.

--saved asks whether tracing the training step on fake tensors, partitioned by AOTAutograd as
inductor partitions it (inductor's decompositions, min-cut partitioner), predicts the bytes a
compiled forward leaves for the backward (saved activations + estimates), measured with the
profiler's allocator events on the real compiled forward.

Every row: the first call (for a compiled model: the compile), the median step, and peak memory of
one step, with ratios to the first row of its table. Steps go round-robin over the rows so that the
load of a shared machine weighs on each alike.
- cpu: `tensors` = peak live tensor bytes (tiersep.memory.trace.tracker.StorageTracker, exact sizes; not
  for compiled rows: Dynamo runs a compiled model eagerly while a TorchDispatchMode is active, so the
  tracker would show the eager figure); `allocator` = peak bytes held through c10's CPU allocator
  (the profiler's memory events: sees inductor's buffers too); `RSS+` = the process's peak resident
  memory during the step (sampled each millisecond) over its value before the step.
  Weights and optimizer state made before the step are in none of the three.
- cuda: `max alloc` = torch.cuda.max_memory_allocated over the step, `device used` = total - free
  from torch.cuda.mem_get_info after it (what nvidia-smi shows for the process: CUDA context,
  allocator cache, every row's weights).
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiersep.config import load_preset, validate  # noqa: E402
from tiersep.memory.trace.tracker import StorageTracker  # noqa: E402
from tiersep.model import build_loss, build_model, count_parameters  # noqa: E402
from tiersep.model.tflocoformer import RotaryEmbedding  # noqa: E402
from tiersep.model.step import make_optimizer, train_step  # noqa: E402

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
# timing and memory


def machine(device: str) -> str:
    """What the figures were measured on: CPU model and cores, or GPU, driver and versions."""
    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        smi = shutil.which("nvidia-smi")
        driver = (subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip().splitlines() or ["?"])[0] \
            if smi else "unknown (no nvidia-smi)"
        return (f"{torch.cuda.get_device_name(0)} ({props.total_memory / MiB:.0f} MiB, "
                f"{props.multi_processor_count} SMs), driver {driver}, CUDA {torch.version.cuda}, "
                f"cuDNN {torch.backends.cudnn.version()}, {versions}")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
            f"{versions}")


class RssSampler:
    """Peak resident set size of this process while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.before = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    @staticmethod
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allocator_bytes(events) -> tuple[int, int]:
    """(bytes still held at the end, peak bytes held) through c10's CPU allocator, from the
    profiler's memory events."""
    from torch.autograd import DeviceType
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events
                            if e.name() == "[memory]" and e.device_type() == DeviceType.CPU):
        live += nbytes
        peak = max(peak, live)
    return live, peak


class StepRunner:
    """One model's training step (forward, loss, backward, AdamW) on a fixed random batch.

    `call` is what the step calls (the model, or its compiled wrapper); `model` owns the weights.
    The first step (compile, AdamW state) is timed apart as `first_seconds`.
    """

    def __init__(self, model: nn.Module, preset: dict, batch_size: int, channels: int, device: str,
                 call: nn.Module | None = None, compiled: bool = False):
        torch.manual_seed(0)
        samples = preset["audio"]["segment_samples"]
        n_src = len(preset["model"]["sources"])
        self.device, self.compiled = device, compiled
        self.batch = [(torch.randn(batch_size, channels, samples, device=device),
                       torch.randn(batch_size, n_src, channels, samples, device=device))]
        self.model, self.preset = model.to(device).train(), preset
        self.call = call if call is not None else self.model
        self.loss_fn, self.optimizer = build_loss(preset), make_optimizer(model, preset, device)
        self.first_seconds = self.step()

    def step(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(self.call, self.loss_fn, self.optimizer, self.batch, self.preset, self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def memory(self) -> dict[str, int | None]:
        """Peak memory of one step (see the module docstring for what each figure counts)."""
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.step()
            free, total = torch.cuda.mem_get_info()
            return {"max alloc": torch.cuda.max_memory_allocated(), "device used": total - free}
        tensors = None
        if not self.compiled:
            with StorageTracker(block_bytes=exact_bytes) as tracker:
                self.step()
            tensors = tracker.peak_bytes
        from torch.profiler import profile
        with profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step()
        allocator = allocator_bytes(prof.profiler.kineto_results.events())[1]
        with RssSampler() as rss:
            self.step()
        return {"tensors": tensors, "allocator": allocator, "RSS+": rss.peak - rss.before}


def measure(runners: dict[str, StepRunner], steps: int) -> dict[str, dict]:
    """Median step seconds (round-robin over the runners), first-call seconds and peak memory."""
    times = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            times[name].append(runner.step())
    return {name: {"first": runner.first_seconds, "seconds": statistics.median(times[name]),
                   **runner.memory()} for name, runner in runners.items()}


def print_table(rows: dict[str, dict], markdown: bool) -> None:
    """Rows with their ratios to the first row; a memory column is blank where not measured."""
    names = list(rows)
    base = rows[names[0]]
    memory = [k for k in base if k not in ("first", "seconds")]
    head = ["", "first call s", "step s", "time ratio"]
    for k in memory:
        head += [f"{k} MiB", f"{k} ratio"]
    lines = [head]
    for name in names:
        row = rows[name]
        cells = [name, f"{row['first']:.2f}", f"{row['seconds']:.3f}", f"{row['seconds'] / base['seconds']:.2f}"]
        for k in memory:
            value, ref = row.get(k), base.get(k)
            cells += ["" if value is None else f"{value / MiB:.1f}",
                      "" if value is None or not ref else f"{value / ref:.2f}"]
        lines.append(cells)
    if markdown:
        print("| " + " | ".join(lines[0]) + " |")
        print("|" + "---|" * len(lines[0]))
        for cells in lines[1:]:
            print("| " + " | ".join(cells) + " |")
    else:
        widths = [max(len(c[i]) for c in lines) for i in range(len(lines[0]))]
        for cells in lines:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    print()


def compiled_runner(model: nn.Module, preset: dict, batch_size: int, channels: int, args) -> StepRunner:
    """Our model through compile_model (inductor, fullgraph), as the trainer would call it."""
    from tiersep.model.compile import compile_model
    model = copy.deepcopy(model).to(args.device)
    call, info = compile_model(model, args.compile_mode, args.cache_dir)
    runner = StepRunner(model, preset, batch_size, channels, args.device, call=call, compiled=True)
    if not info["compiled"]:
        sys.exit(f"torch.compile fell back to eager: {info['reason']}")
    return runner


def reference_compiled_runner(reference: nn.Module, preset: dict, batch_size: int, args) -> StepRunner:
    """The reference under plain torch.compile (args.compile_mode), as speed.jsonl's compiled MERL row."""
    model = copy.deepcopy(reference).to(args.device)
    return StepRunner(model, preset, batch_size, 1, args.device, call=torch.compile(model, mode=args.compile_mode),
                      compiled=True)


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
    print(f"reference: {args.reference}:{SEPARATOR_FILE}; RoPE: {rope_from}\n")
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
        runners = {"reference": StepRunner(reference, preset, batch_size, 1, args.device),
                   "tiersep eager (auto)": StepRunner(ours, preset, batch_size, 1, args.device),
                   "tiersep eager (math)": StepRunner(ours_math, preset, batch_size, 1, args.device)}
        if args.compile:
            runners["tiersep compiled (auto)"] = compiled_runner(ours, preset, batch_size, 1, args)
            runners["reference compiled"] = reference_compiled_runner(reference, preset, batch_size, args)
        print_table(measure(runners, args.steps), args.markdown)


def time_tiers(args) -> None:
    print(f"== our training step on the CPU tiers (stereo, preset batch size, fp32, AdamW), "
          f"median of {args.steps} steps\n")
    for name in ("cpu_tiny", "cpu_small"):
        preset = copy.deepcopy(load_preset(str(ROOT / "config" / "presets" / f"{name}.yaml")))
        preset["train"]["precision"] = "fp32"
        torch.manual_seed(0)
        model = build_model(preset)
        batch_size, channels = preset["train"]["batch_size"], preset["audio"]["channels"]
        print(f"{name}: {count_parameters(model):,} parameters, batch {batch_size}, "
              f"{preset['audio']['segment_samples']} samples")
        runners = {"tiersep eager": StepRunner(copy.deepcopy(model), preset, batch_size, channels, args.device)}
        if args.compile:
            runners["tiersep compiled"] = compiled_runner(model, preset, batch_size, channels, args)
        print_table(measure(runners, args.steps), args.markdown)


def forward_bytes(call, mixture) -> tuple[int, int]:
    """(bytes still held after a training-mode forward: saved activations + estimates, peak of the
    forward), through c10's CPU allocator."""
    from torch.profiler import profile
    with profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        estimates = call(mixture)
    del estimates
    return allocator_bytes(prof.profiler.kineto_results.events())


def partitioned_forward_outputs(preset: dict, shape: tuple) -> int:
    """Bytes of the forward graph's outputs (estimates + tensors saved for backward) when
    AOTAutograd partitions the step as inductor does (its decompositions, min-cut partitioner),
    traced on fake tensors: nothing is computed."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    found = {}

    def forward_compiler(gm, example_inputs):
        inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        storages = {}
        for node in outputs:  # new storages only: a saved weight or input costs nothing
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and node not in inputs:
                storages[id(value.untyped_storage())] = value.untyped_storage().nbytes()
        found["bytes"] = sum(storages.values())
        return gm

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    with FakeTensorMode():
        model = build_model(preset).train()
        torch.compile(model, fullgraph=True, backend=backend)(torch.randn(*shape))
    torch._dynamo.reset()
    return found["bytes"]


def saved_activations(args) -> None:
    """Does the partitioned graph traced on fake tensors predict a compiled step's saved activations?"""
    print("== saved activations of one forward (training mode), CPU tiers, batch 1, fp32\n")
    print("| preset | predicted (fake-tensor partition) MiB | inductor MiB | eager MiB | "
          "inductor forward peak MiB | eager forward peak MiB |")
    print("|---|---|---|---|---|---|")
    for name in ("cpu_tiny", "cpu_small"):
        preset = load_preset(str(ROOT / "config" / "presets" / f"{name}.yaml"))
        shape = (1, preset["audio"]["channels"], preset["audio"]["segment_samples"])
        predicted = partitioned_forward_outputs(preset, shape)
        torch.manual_seed(0)
        model = build_model(preset).train()
        mixture = torch.randn(*shape)
        compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
        figures = {}
        for label, call in (("eager", model), ("inductor", compiled)):
            call(mixture).sum().backward()  # compile, and make every lazy buffer
            figures[label] = forward_bytes(call, mixture)
        print(f"| {name} | {predicted / MiB:.2f} | {figures['inductor'][0] / MiB:.2f} | "
              f"{figures['eager'][0] / MiB:.2f} | {figures['inductor'][1] / MiB:.2f} | "
              f"{figures['eager'][1] / MiB:.2f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="tf-locoformer checkout (work tree or git dir)")
    parser.add_argument("--reference-deps", type=Path, help="folder holding rotary_embedding_torch, einops")
    parser.add_argument("--tiers", action="store_true", help="time our step on cpu_tiny and cpu_small")
    parser.add_argument("--compile", action="store_true", help="add our model under torch.compile")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode (train.compile_mode)")
    parser.add_argument("--cache-dir", type=Path, help="inductor/Triton cache folder (default: torch's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on the CPU (1: steadiest on a shared machine)")
    parser.add_argument("--saved", action="store_true",
                        help="CPU tiers: saved activations of a compiled forward, predicted on fake "
                             "tensors against measured")
    parser.add_argument("--markdown", action="store_true", help="tables in Markdown")
    args = parser.parse_args()
    if not (args.reference or args.tiers or args.saved):
        parser.error("give --reference PATH, --tiers and/or --saved")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    print(f"device: {args.device}: {machine(args.device)}\n")
    if args.reference:
        compare_with_reference(args)
    if args.tiers:
        time_tiers(args)
    if args.saved:
        saved_activations(args)


if __name__ == "__main__":
    main()
