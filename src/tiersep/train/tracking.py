"""Where a run's curves go besides metrics.csv, while it trains: TensorBoard event files in the run
folder's tb/ (config tracking.tensorboard, on by default) and Weights & Biases when
tracking.wandb.project is given (docs/training.md#watch-a-run).

The loop hands a Tracker the same rows it appends to metrics.csv and memory.csv, so the curves and
the CSV files never disagree: `log_step` every step, `log_validation` at each validation with
whatever `val_*` scores it made (a key such as val_si_sdr_ema simply appears as val/si_sdr_ema) and
a few seconds of audio per stem. Rank 0 alone tracks (the other ranks write nothing).

A resumed run continues the same curves: the TensorBoard writer opens with purge_step = the
checkpoint's step + 1 (TensorBoard's own mechanism: events the killed process wrote after the
checkpoint are dropped), and the W&B run keeps its id (carried by the checkpoints' run bookkeeping).
Events are flushed every step, as the CSV rows are, so a killed run's curves reach its last step.
"""
from __future__ import annotations

import math
import netrc
import os
import secrets
from pathlib import Path
from urllib.parse import urlparse

import torch

from tiersep.config import ConfigError

# Imported with the trainer (not when a run starts): the CPU booking's probe process, which imports
# what `tiersep train` imports (memory/cpu_booking.py), then counts its pages.
try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError as _err:   # said in one line at job start when tracking.tensorboard is on
    SummaryWriter, TENSORBOARD_MISSING = None, str(_err)
else:
    TENSORBOARD_MISSING = None

TB_DIR, WANDB_DIR = "tb", "wandb"
# Row keys that are bookkeeping, not curves.
NOT_CURVES = {"step", "time_s"}


class TrackingError(ConfigError):
    """A tracking section this job cannot carry out (W&B asked for but not installed, no key for
    online mode): one line at job start, exit 2 like every bad input."""


def tracking_problem(cfg: dict) -> str | None:
    """One line naming what stops the config's tracking section at job start, or None. Checked
    before the run folder is touched, so the job ends before training rather than mid-run."""
    where, tracking = cfg.get("_source", "config"), cfg["tracking"]
    if tracking["tensorboard"] and SummaryWriter is None:
        return (f"{where}: tracking.tensorboard is true, but TensorBoard cannot be imported "
                f"({TENSORBOARD_MISSING}); pip install tensorboard, or set tracking.tensorboard: false")
    wandb = tracking["wandb"]
    if wandb["project"] is None:
        return None
    try:
        import wandb as _wandb  # noqa: F401
    except ImportError as err:
        return (f"{where}: tracking.wandb.project is set, but the wandb package cannot be imported ({err}); "
                "pip install 'tiersep[wandb]', or remove tracking.wandb.project")
    if wandb["mode"] == "online" and not wandb_key_present():
        return (f"{where}: tracking.wandb.mode is online, but no W&B API key was found (WANDB_API_KEY, or "
                "`wandb login`); set one, or use tracking.wandb.mode: offline and `wandb sync` later")
    return None


def wandb_key_present() -> bool:
    """Whether online W&B has a key: WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def curve_name(key: str) -> str:
    """The curve a metrics row key is logged as: val_si_sdr -> val/si_sdr, loss -> train/loss."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def memory_curves(memory: dict, device_type: str) -> dict:
    """A memory.csv row as curves: allocated, reserved and peak on CUDA; the RSS and its peak on CPU
    (where the probe's allocated and reserved are both the RSS)."""
    if device_type == "cuda":
        return {f"memory/{k}_bytes": memory[k] for k in ("allocated", "reserved", "peak")}
    return {"memory/rss_bytes": memory["allocated"], "memory/peak_rss_bytes": memory["peak"]}


def numbers(values: dict) -> dict:
    """The entries that are numbers (a row's empty fields are None)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """The curves of one run (rank 0): TensorBoard and/or W&B, or nothing when neither is on."""

    def __init__(self, device_type: str, sample_rate: int, tensorboard=None, wandb_run=None):
        self.device_type, self.sample_rate = device_type, sample_rate
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @classmethod
    def open(cls, cfg: dict, out_dir: Path, preset: dict, device_type: str, step: int,
             run_info: dict, estimate: dict | None) -> "Tracker":
        """The tracker of a run that continues from `step` (0: a new run). run_info is the run's
        checkpoint bookkeeping: the W&B run id is kept there, so a resumed run continues it."""
        tracking = cfg["tracking"]
        tensorboard = wandb_run = None
        if tracking["tensorboard"]:
            # purge_step: events at or after it (a killed process's, past its checkpoint) are dropped
            tensorboard = SummaryWriter(log_dir=str(Path(out_dir) / TB_DIR), purge_step=step + 1)
        if tracking["wandb"]["project"] is not None:
            wandb_run = _start_wandb(tracking["wandb"], Path(out_dir), preset, run_info, estimate)
        return cls(device_type, preset["audio"]["sample_rate"], tensorboard, wandb_run)

    def log_step(self, step: int, row: dict, memory: dict) -> None:
        """One training step: every number of its metrics row but the validation scores (those are
        log_validation's), and its memory.csv row."""
        curves = {curve_name(k): v for k, v in numbers(row).items()
                  if k not in NOT_CURVES and not k.startswith("val_")}
        self._scalars(step, {**curves, **memory_curves(memory, self.device_type)})

    def log_validation(self, step: int, metrics: dict, audio: dict) -> None:
        """One validation: its val_* scores (whatever keys it made) and audio {name: Tensor[S]}."""
        self._scalars(step, {curve_name(k): v for k, v in numbers(metrics).items() if k.startswith("val_")})
        for name, wave in audio.items():
            wave = wave.detach().float().clamp(-1.0, 1.0).cpu()
            if self.tensorboard is not None:
                self.tensorboard.add_audio(f"audio/{name}", wave.unsqueeze(0), step, sample_rate=self.sample_rate)
            if self.wandb_run is not None:
                import wandb

                self.wandb_run.log({f"audio/{name}": wandb.Audio(wave.numpy(), sample_rate=self.sample_rate)},
                                   step=step)

    def _scalars(self, step: int, curves: dict) -> None:
        if self.tensorboard is not None:
            for tag, value in curves.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb_run is not None and curves:
            self.wandb_run.log({k: (v if math.isfinite(v) else None) for k, v in curves.items()}, step=step)

    def flush(self) -> None:
        """Write out what is queued (every step, as the CSV rows are: a killed run keeps its curves)."""
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(settings: dict, out_dir: Path, preset: dict, run_info: dict, estimate: dict | None):
    """A W&B run in out_dir/wandb/ (offline: nothing leaves the machine), continuing the id the
    run's checkpoints carry; its config is the resolved preset and the estimate record."""
    import wandb

    run_id = run_info.get("wandb_id") or secrets.token_hex(4)
    run_info["wandb_id"] = run_id
    try:
        return wandb.init(project=settings["project"], entity=settings["entity"], mode=settings["mode"],
                          dir=str(out_dir), id=run_id, resume="allow", name=preset["name"],
                          config={"preset": preset, "estimate": estimate},
                          settings=wandb.Settings(console="off"))
    except Exception as err:  # noqa: BLE001 - wandb's own failures (network, auth) in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(f"tracking.wandb: W&B could not start the run ({first})") from None


def validation_audio(mixtures: torch.Tensor, estimates: torch.Tensor, sources: list[str],
                     samples: int) -> dict:
    """The first `samples` of the validation mixture and of each stem's estimate, segment after
    segment: {"mixture": Tensor[samples], stem: Tensor[samples]}. mixtures [N, S] and estimates
    [N, n, S], the first N validation segments downmixed to mono."""
    if samples <= 0:
        return {}
    out = {"mixture": mixtures.float().reshape(-1)[:samples]}
    for index, stem in enumerate(sources):
        out[stem] = estimates[:, index].float().reshape(-1)[:samples]
    return out
