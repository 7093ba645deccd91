"""`fit()`: derive a variant of a preset whose training step fits a memory budget.

Levers, from the one that changes training least to the one that changes it most:
  1. a fused attention kernel instead of math (same maths, O(L) memory);
  2. a smaller micro-batch with more accumulation (same effective batch batch_size * grad_accum);
  3. per-block gradient checkpointing (same maths, about a third more compute);
  4. 16-bit autocast (norms, RoPE, STFT and the residual stream stay fp32): bf16, or fp16 with the
     loss scaler on a card without native bf16 (tiersep.gpu_catalogue);
  5. a shorter training segment (changes what the model sees: last resort).
The search keeps the longest segment, then the fewest levers, then the largest micro-batch, using
the instant `analytic` form scaled by trace/analytic of the original preset, and verifies the choice
with `trace` (stepping further down if the trace disagrees). A candidate fits when the gate would
pass it: its record goes through `estimate.finish`, the one place `fits` is set. It writes nothing;
the CLI does.

On CUDA the search models one card (a gpu_catalogue entry): its kernels decide what `auto` attention
runs (no flash before sm80) and its precision lever (fp16 where bf16 is not native). A preset the card
cannot run as written (bf16 on a T4, flash forced where there is none) is first made runnable, and
that change is listed with the others.

`FitSearch` holds one preset's search (its trace, the analytic scale, every trace it ran), so one
search answers many budgets with one trace per distinct variant (`tiersep fit --gpus`, fit_matrix).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from .. import accuracy, analytic, calibration
from ..conditions import Conditions, decide
from ..constants import GIB, MIB
from ..estimate import estimate, finish, for_card, modelled_gpu, with_booking
from .settings import GateSettings
from tiersep.gpu_catalogue import GpuEntry

ROUNDS = 4   # trace checks before giving up: each tightens the analytic form to what the trace said
# A shorter segment's first guess aims this far below the budget: the closed form anchored on the
# frugal variant's trace is within about +-2% of the trace across segment lengths (seed presets),
# so the first trace check usually confirms the guess: one trace per budget, for ~2% of segment.
SEGMENT_CUSHION = 0.02


class NothingFits(ValueError):
    """No variant of the preset fits the budget. `smallest_budget_bytes`: the least budget at which
    the most frugal variant would fit (None when the search could not tell); `floor`: that
    variant's trace record."""

    def __init__(self, message: str, smallest_budget_bytes: int | None = None, floor: dict | None = None):
        super().__init__(message)
        self.smallest_budget_bytes, self.floor = smallest_budget_bytes, floor


@dataclass
class Fitted:
    variant: dict        # the preset that fits (the original itself when it fits as is)
    changes: list[str]   # describe_changes(original, variant); [] when it fits as is
    record: dict         # its trace estimate, with the verdict against the budget


def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def _variant(preset: dict, segment: int, micro: int, effective: int, ckpt: bool, half: str | None,
             backend: str) -> dict:
    v = copy.deepcopy(preset)
    v["audio"]["segment_samples"] = segment
    v["train"]["batch_size"] = micro
    v["train"]["grad_accum"] = effective // micro
    v["model"]["checkpointing"] = ckpt
    v["train"]["precision"] = half or v["train"]["precision"]
    v["model"]["attention_backend"] = backend
    return v


def describe_changes(old: dict, new: dict) -> list[str]:
    """One line per changed field, in the order a reader wants them."""
    changes = []
    o, n = old["model"]["attention_backend"], new["model"]["attention_backend"]
    if o != n:
        changes.append(f"model.attention_backend: {o} -> {n} (fused kernel, O(L) memory, same maths)")
    ob, nb = old["train"]["batch_size"], new["train"]["batch_size"]
    if ob != nb:   # ranks are kept: the micro-batch is per rank, the effective batch x ranks
        ranks = old["train"].get("ranks", 1)
        per_rank = " per rank" if ranks > 1 else ""
        changes.append(f"train.batch_size: {ob} -> {nb} and train.grad_accum: {old['train']['grad_accum']} -> "
                       f"{new['train']['grad_accum']}{per_rank} (effective batch "
                       f"{ob * old['train']['grad_accum'] * ranks} kept" + (f", {ranks} ranks)" if ranks > 1 else ")"))
    if old["model"]["checkpointing"] != new["model"]["checkpointing"]:
        changes.append("model.checkpointing: false -> true (per-block recomputation, ~1/3 more compute)")
    if old["train"]["precision"] != new["train"]["precision"]:
        why = " with the loss scaler" if new["train"]["precision"] == "fp16" else ""
        changes.append(f"train.precision: {old['train']['precision']} -> {new['train']['precision']} (autocast{why})")
    os_, ns = old["audio"]["segment_samples"], new["audio"]["segment_samples"]
    if os_ != ns:
        rate = old["audio"]["sample_rate"]
        changes.append(f"audio.segment_samples: {os_} -> {ns} ({os_ / rate:.2f} s -> {ns / rate:.2f} s)")
    return changes


def runnable_on(preset: dict, gpu: GpuEntry | None) -> tuple[dict, list[str]]:
    """`preset` made runnable on card `gpu` (None: any sm80+ card, which runs everything), and why:
    bf16 where it is not native becomes fp16 with the loss scaler; a fused kernel forced where it
    does not run becomes auto (the kernel torch picks there)."""
    if gpu is None:
        return preset, []
    out, why = copy.deepcopy(preset), []
    if out["train"]["precision"] == "bf16" and not gpu.bf16:
        out["train"]["precision"] = "fp16"
        why.append(f"the {gpu.model} ({gpu.sm}) has no native bf16")
    half = out["train"]["precision"] if out["train"]["precision"] in ("bf16", "fp16") else None
    backend = out["model"]["attention_backend"]
    if backend in ("flash", "efficient") and not gpu.runs(backend, half):
        out["model"]["attention_backend"] = "auto"
        why.append(f"the {gpu.model} ({gpu.sm}) runs no {backend} kernel for {half or 'fp32'}")
    return out, why


def half_lever(gpu: GpuEntry | None) -> str:
    """The precision lever on card `gpu`: its 16-bit type (bf16 where native, else fp16; None: any
    sm80+ card)."""
    return "bf16" if gpu is None or gpu.bf16 else "fp16"


def kernel_note(cond: Conditions) -> list[str]:
    """One line when the card runs another attention kernel than an sm80+ card would (no flash)."""
    if cond.gpu is None or "flash" in cond.gpu.kernels or cond.attention == "flash":
        return []
    return [f"attention runs {cond.attention} on the {cond.gpu.model} ({cond.gpu.sm}: no flash kernel before sm80)"]


def fitted_name(preset: dict, budget_bytes: int) -> str:
    """`P_fit_<budget>gib`, a decimal point written as `p` (large_fit_24gib, small_fit_3p5gib)."""
    gib = f"{budget_bytes / GIB:g}"
    return f"{preset['name']}_fit_{gib.replace('.', 'p')}gib"


class FitSearch:
    """The fit search for one preset on one device, margin and calibration. Traces are kept by
    variant, so asking for several budgets traces each distinct variant once."""

    def __init__(self, preset: dict, device: str, settings: GateSettings, estimate_record: dict | None = None,
                 gpu: GpuEntry | None = None, shared: dict | None = None):
        """`estimate_record`: the preset's own trace estimate when one was made already (the
        workflow's results/vram/<tier>.json); used instead of tracing it again when it was made for
        this device, calibration, allocator, torch, card and the preset's settings (`reusable`).
        `gpu` (cuda): the card modelled; None: the one an estimate picks (estimate.modelled_gpu).
        `shared`: traces of other cards' searches of this preset (the fit matrix's columns), by the
        preset as it runs and the calibration: a card that runs the same preset restates them
        (estimate.for_card) instead of tracing again."""
        self.device, self.user_preset = device, preset
        self.margin, self.spec = settings.safety_margin, settings.calibration_spec
        self.cal = calibration.resolve(self.spec) if device == "cuda" else None
        self.gpu = (gpu or modelled_gpu(None, self.cal, self.spec)) if device == "cuda" else None
        preset, self.made_runnable = runnable_on(preset, self.gpu)
        self.preset = preset
        self.traces: dict[str, dict] = {}
        self.shared = shared
        self.traced_here = 0          # traces this search ran itself (not reused, not restated)
        self.numels = analytic.parameter_numels(preset)
        self.conditions = self.decide(preset)          # the preset's; each variant decides its own
        self.reused = int(estimate_record is not None and self.reusable(estimate_record))
        if self.reused:
            self.traces[self._key(preset)] = copy.deepcopy(estimate_record)
        self.original = self.traced(preset)
        self.coefficients = analytic.load_calibration()
        # Scale the closed form to this preset's trace so the search is centred on the trace.
        self.ratio = self.original["peak_bytes"] / self._analytic_peak(preset, self.conditions)
        t, m = preset["train"], preset["model"]
        self.effective = t["batch_size"] * t["grad_accum"]
        self.backend = "auto" if self.conditions.attention == "math" else m["attention_backend"]
        self.half = half_lever(self.gpu)
        self.half_options = [None] if t["precision"] in ("bf16", "fp16") else [None, self.half]
        self.ckpt_options = [True] if m["checkpointing"] else [False, True]

    # ---- estimates ----------------------------------------------------------------------------
    def decide(self, variant: dict) -> Conditions:
        return decide(variant, self.device, gpu=self.gpu)

    def changes(self, variant: dict) -> list[str]:
        """What differs from the preset as given, the card's own needs first."""
        made = describe_changes(self.user_preset, self.preset)
        later = [c for c in describe_changes(self.user_preset, variant) if c not in made]
        return [f"{line} ({'; '.join(self.made_runnable)})" for line in made] + later + (kernel_note(self.decide(variant)) if self.device == "cuda" else [])

    @staticmethod
    def _key(variant: dict) -> str:
        return json.dumps(variant, sort_keys=True, default=str)

    def reusable(self, record: dict) -> bool:
        """Whether `record` is the trace estimate of this preset as `traced` would make it: the same
        method, device, preset name and settings, parameter count, calibration, allocator mode and
        torch (a record of another preset of that name would pass: give the workflow's own)."""
        import torch

        p, t = self.preset, self.preset["train"]
        same = {"method": "trace", "device": self.device, "preset": p["name"], "precision": t["precision"],
                "batch_size": t["batch_size"], "grad_accum": t["grad_accum"], "torch": torch.__version__,
                "segment_samples": p["audio"]["segment_samples"], "checkpointing": p["model"]["checkpointing"],
                "parameters": sum(self.numels)}
        if any(record.get(k) != v for k, v in same.items()) or "uncertainty" not in record:
            return False
        if record.get("ranks", 1) != t.get("ranks", 1):    # a rank's figures (memory/trace/ranks.py)
            return False
        if self.device != "cuda":
            return True
        used = record.get("calibration") or {}
        return (all(used.get(k) == self.cal["used"][k] for k in ("name", "source"))
                and used.get("context_bytes") == self.cal["context_bytes"]
                and (record.get("allocator") or {}).get("expandable_segments")
                == self.conditions.expandable_segments
                and (record.get("gpu") or {}).get("name") == (self.conditions.gpu_record() or {}).get("name"))

    def traced(self, variant: dict) -> dict:
        """The trace estimate of `variant` without a budget (`verdict` judges it), run once."""
        key = self._key(variant)
        if key not in self.traces:
            cond = self.decide(variant)
            as_run = cond.applied(variant)
            used = self.cal["used"] if self.cal else {}
            common = (self._key(as_run), used.get("name"), used.get("source"))
            seen = self.shared.get(common) if self.shared is not None else None
            record = for_card(seen, as_run, cond) if seen is not None else None
            if record is None:
                record = estimate(variant, "trace", self.device, None, self.margin, self.spec, gpu=self.gpu)
                self.traced_here += 1
                if self.shared is not None:
                    self.shared.setdefault(common, record)
            self.traces[key] = record
        return self.traces[key]

    def verdict(self, record: dict, budget_bytes: int) -> dict:
        """`record` judged against `budget_bytes` as the gate judges it (estimate.finish)."""
        return finish(copy.deepcopy(record), budget_bytes, self.margin, record.get("seconds", 0.0))

    def _analytic_peak(self, variant: dict, cond: Conditions) -> float:
        return analytic.predict(variant, cond, calibration=self.coefficients, numels=self.numels,
                                device_cal=self.cal)["peak"]

    def _analytic_record(self, variant: dict, scale: float, uncertainty: float) -> dict:
        """The closed form of `variant`, scaled to the trace, as an estimate record the gate can judge:
        the original's fields, the variant's settings, and on cuda the uncertainty of the variant's
        class as estimate() states it (at least `uncertainty`)."""
        record = {k: v for k, v in self.original.items() if k != "cpu_process"}
        t, cond = variant["train"], self.decide(variant)
        record.update(peak_bytes=int(scale * self.ratio * self._analytic_peak(variant, cond)), uncertainty=uncertainty,
                      precision=cond.precision, batch_size=t["batch_size"], grad_accum=t["grad_accum"],
                      segment_samples=variant["audio"]["segment_samples"],
                      checkpointing=variant["model"]["checkpointing"],
                      attention_backend=cond.traced_kernel(variant))
        if "uncertainty_class" in self.original:   # the gate books peak x (1 + its class's uncertainty)
            record["uncertainty"] = max(uncertainty, accuracy.uncertainty(accuracy.estimate_class(record))[0])
        return with_booking(record, variant)

    # ---- the search ---------------------------------------------------------------------------
    def fit(self, budget_bytes: int) -> Fitted:
        """The nearest variant that fits `budget_bytes`, verified by trace; raises NothingFits.
        Long because the rounds share one state (the analytic scale and uncertainty) that each
        trace check updates, and the steps read best as one story."""
        if budget_bytes is None or budget_bytes <= 0:
            raise ValueError("fit: a positive budget in bytes is needed")
        first = self.verdict(self.original, budget_bytes)
        if first["fits"]:
            return Fitted(copy.deepcopy(self.preset), self.changes(self.preset), first)
        a = self.preset["audio"]
        # on cuda each candidate books its own class's uncertainty; this floor rises when a trace says more
        correction = 1.0
        uncertainty = 0.0 if "uncertainty_class" in self.original else self.original["uncertainty"]

        def fits(v: dict, scale: float) -> bool:
            return bool(self.verdict(self._analytic_record(v, scale, uncertainty), budget_bytes)["fits"])

        def best_at(segment: int, scale: float) -> dict | None:
            """Fewest levers, then the largest micro-batch, that fit at this segment length."""
            for half in self.half_options:
                for ckpt in self.ckpt_options:
                    for micro in _divisors_desc(self.effective, self.preset["train"]["batch_size"]):
                        v = _variant(self.preset, segment, micro, self.effective, ckpt, half, self.backend)
                        if fits(v, scale):
                            return v
            return None

        def longest_segment(scale: float) -> int | None:
            """Largest segment (a multiple of hop, >= n_fft) at which the most frugal variant fits."""
            hop, lo = a["hop"], -(-a["n_fft"] // a["hop"])
            hi = a["segment_samples"] // hop
            if not fits(self.frugal(lo * hop), scale):
                return None
            while lo < hi:   # the analytic peak grows with the segment
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(self.frugal(mid * hop), scale) else (lo, mid - 1)
            return lo * hop

        for _ in range(ROUNDS):
            scale = correction
            choice = best_at(a["segment_samples"], scale)
            if choice is None:   # a shorter segment: anchored on the frugal variant's own trace
                scale = correction * self.segment_anchor() * (1 + SEGMENT_CUSHION)
                segment = longest_segment(scale)
                choice = best_at(segment, scale) if segment is not None else None
            if choice is None:
                break
            checked = self.verdict(self.traced(choice), budget_bytes)
            if checked["fits"]:
                fitted = copy.deepcopy(choice)
                fitted["name"] = fitted_name(self.preset, budget_bytes)
                changes = self.changes(fitted)
                on = f"{self.device}, {self.gpu.model}" if self.gpu is not None else self.device
                fitted["description"] = (f"{self.preset['name']} fitted to {budget_bytes / GIB:g} GiB ({on}): "
                                         f"{'; '.join(changes)}. Trace estimate {checked['peak_bytes'] / GIB:.2f} GiB.")
                return Fitted(fitted, changes, checked)
            # the trace disagrees: correct the closed form by how far it was off, and book at least
            # the uncertainty the trace states for this variant's class
            predicted = self.verdict(self._analytic_record(choice, scale, uncertainty), budget_bytes)
            correction *= checked["gate_required_bytes"] / max(predicted["gate_required_bytes"], 1) * 1.02
            uncertainty = max(uncertainty, checked["uncertainty"])
        raise self.nothing_fits(budget_bytes)

    def segment_anchor(self) -> float:
        """trace / scaled closed form of the most frugal variant at the preset's own segment: the
        shorter-segment search is centred on a trace of its own mode, not the original's (traced
        once, whatever the budget)."""
        v = self.frugal(self.preset["audio"]["segment_samples"])
        return self.traced(v)["peak_bytes"] / (self.ratio * self._analytic_peak(v, self.decide(v)))

    def frugal(self, segment: int | None = None) -> dict:
        """Every lever pulled: micro-batch 1, checkpointing, 16-bit, a fused kernel; at `segment`
        samples (default the shortest the search tries: n_fft rounded up to a whole hop)."""
        a = self.preset["audio"]
        if segment is None:
            segment = -(-a["n_fft"] // a["hop"]) * a["hop"]
        return _variant(self.preset, segment, 1, self.effective, True, self.half, self.backend)

    def smallest_budget(self) -> tuple[int, dict]:
        """(the least budget the most frugal variant fits, to the MiB, as the gate judges it; its trace
        record)."""
        record = self.traced(self.frugal())
        lo, hi = 0, max(int(record["gate_required_bytes"]), MIB)
        while not self.verdict(record, hi)["fits"]:
            lo, hi = hi, hi * 2
        while hi - lo > MIB:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.verdict(record, mid)["fits"] else (mid, hi)
        return -(-hi // MIB) * MIB, record

    def nothing_fits(self, budget_bytes: int) -> NothingFits:
        a = self.preset["audio"]
        smallest, floor = self.smallest_budget()
        if smallest <= budget_bytes:   # the trace says the frugal variant fits: the search lost its way
            smallest, would = None, ""
        else:
            would = f", which needs a budget of {smallest / GIB:.2f} GiB"
        return NothingFits(
            f"preset {self.preset['name']}: nothing fits {budget_bytes / GIB:.2f} GiB on {self.device} with a "
            f"{self.margin:.0%} margin, not even micro-batch 1 with checkpointing, {self.half}, a fused attention "
            f"kernel and the shortest segment ({a['n_fft']} samples){would}; the original needs "
            f"{self.original['peak_bytes'] / GIB:.2f} GiB. Reduce model.n_layers / model.emb_dim, or use a larger GPU.",
            smallest, floor)


def fit(preset: dict, budget_bytes: int, device: str, settings: GateSettings,
        gpu: GpuEntry | None = None) -> tuple[dict, list[str]]:
    """A variant of `preset` whose estimated peak plus the safety margin is within `budget_bytes`
    (on card `gpu` on cuda), and the changes made ([] and the preset itself when it fits as is)."""
    if budget_bytes is None or budget_bytes <= 0:
        raise ValueError("fit: a positive budget in bytes is needed")
    found = FitSearch(preset, device, settings, gpu=gpu).fit(budget_bytes)
    return found.variant, found.changes
