"""Gather whatever results exist into one record per tier, plus the facts of the run.

Nothing here assumes a stage finished: every file is optional, and a tier with missing or failed
results is still a row (status says why). Every JSON record is checked against its schema
(tiersep.records: extra fields are fine, NaN and ±inf are not); a file that exists but cannot be
read or breaks its schema is left out and becomes a problem of its tier, shown on the page as a
failure naming the file and the field: a corrupt result neither disappears silently nor stops the
report. The same holds for metrics.csv and memory.csv (read_csv), and for the excerpt of the
Listen section (tiersep.report.listen).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tiersep import config as C
from tiersep.memory.constants import BREAKDOWN_KEYS  # noqa: F401 - the estimate's parts, in report order
from tiersep.records import RecordError, read_record
from tiersep.report.listen import Listen, read_listen


def device_type(device: str | None) -> str | None:
    """'cuda:0 (NVIDIA ...)' -> 'cuda', 'cpu (x86_64, 2 threads)' -> 'cpu'."""
    match = re.match(r"\s*([A-Za-z]+)", str(device or ""))
    return match.group(1).lower() if match else None


class ReportInputError(ValueError):
    """A results CSV that exists but cannot be read; the message names the file."""


@dataclass
class Tier:
    name: str
    kind: str  # "tier" (config tiers), "estimate" (estimate_tiers only), "found"
    preset: dict | None = None
    preset_error: str | None = None
    estimate: dict | None = None  # results/vram/<name>.json
    run: dict | None = None  # results/train/<name>/run.json
    failure: dict | None = None  # results/train/<name>/failure.json: the last attempt failed
    earlier_failure: dict | None = None  # run.json's recovered_from: an OOM the retry got past
    metrics: list[dict] = field(default_factory=list)  # metrics.csv rows, numbers or None
    memory: list[dict] = field(default_factory=list)  # memory.csv rows
    scores: dict | None = None  # results/eval/<name>/scores.json
    listen: Listen | None = None  # results/eval/<name>/listen/: the excerpt the page plays
    listen_error: str | None = None  # why that excerpt cannot be played (also in problems)
    problems: list[str] = field(default_factory=list)  # records that could not be read, one line each

    # ---- derived views the tables and plots share -------------------------------------------
    @property
    def status(self) -> str:
        """One of: failed, refused, invalid, trained, evaluated, incomplete, estimate, missing."""
        if self.failure is not None:
            return "refused" if self.failure.get("kind") == "refused" else "failed"
        if self.problems or self.preset_error:
            return "invalid"
        if self.scores is not None:
            return "evaluated"
        if self.run is not None:
            return "trained"
        if self.metrics or self.memory:
            return "incomplete"
        if self.kind == "estimate" and self.estimate is not None:
            return "estimate"
        return "missing"

    @property
    def status_text(self) -> str:
        if self.failure is not None:
            kind = self.failure.get("kind", "error")
            label = {"oom": "failed: out of memory", "refused": "refused before training",
                     "error": "failed: error"}.get(kind, f"failed: {kind}")
            attempt = self.failure.get("attempt")
            return f"{label} (attempt {attempt})" if attempt and attempt > 1 else label
        status = self.status
        if status == "invalid":
            return "preset does not load" if self.preset_error else "invalid record"
        if status == "evaluated":
            text = "trained and evaluated"
        elif status == "trained":
            text = "trained, not evaluated"
        elif status == "incomplete":
            text = f"incomplete (last step {self.last_step})"
        elif status == "estimate":
            text = "estimate only"
        elif self.kind == "estimate":
            text = "no estimate yet"
        else:
            text = "not run yet"
        if self.earlier_failure is not None and self.run is not None:
            text += f" on attempt {self.run.get('attempt')} (after an out-of-memory failure)"
        return text

    @property
    def last_step(self) -> int | None:
        steps = [row["step"] for row in self.metrics + self.memory if row.get("step") is not None]
        return int(max(steps)) if steps else None

    @property
    def measured_device(self) -> str | None:
        """The device the run used, as recorded ('cuda:0 (NVIDIA H100 80GB HBM3)', 'cpu (x86_64, 2
        threads)', 'cuda', ...)."""
        for record in (self.run, self.failure):
            if record and record.get("device"):
                return str(record["device"])
        return None

    @property
    def measured_device_type(self) -> str | None:
        for record in (self.run, self.failure):
            if record and record.get("device_type"):
                return str(record["device_type"])
        return device_type(self.measured_device)

    def _run_or_max(self, key: str, rows: list[dict], pick) -> float | None:
        """run.json's `key` when the run finished; else the largest `pick(row)` logged so far."""
        if self.run and self.run.get(key) is not None:
            return float(self.run[key])
        values = [v for v in map(pick, rows) if v is not None]
        return max(values) if values else None

    @property
    def estimated_peak(self) -> float | None:
        """The estimate record's peak_bytes (results/vram/<name>.json)."""
        if self.estimate and self.estimate.get("peak_bytes") is not None:
            return float(self.estimate["peak_bytes"])
        return None

    def overall(self, key: str) -> float | None:
        """A test score, mean of stems (None when not evaluated or not a finite number)."""
        value = ((self.scores or {}).get("overall") or {}).get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    @property
    def overall_si_sdr(self) -> float | None:
        return self.overall("si_sdr")

    @property
    def frames(self) -> tuple[int, int] | None:
        """(valid, total) museval frames over every test track and stem, from scores.json."""
        entries = [entry for stems in ((self.scores or {}).get("per_track") or {}).values()
                   for entry in stems.values()]
        if not entries or any("frames" not in e for e in entries):
            return None
        return sum(e["valid_frames"] for e in entries), sum(e["frames"] for e in entries)

    @property
    def steps(self) -> int | None:
        if self.run and self.run.get("steps") is not None:
            return int(self.run["steps"])
        return self.last_step

    @property
    def wall_seconds(self) -> float | None:
        return self._run_or_max("wall_seconds", self.metrics, lambda row: row.get("time_s"))

    @property
    def steps_per_s(self) -> float | None:
        if self.run and self.run.get("steps_per_s") is not None:
            return float(self.run["steps_per_s"])
        if self.steps and self.wall_seconds:
            return self.steps / self.wall_seconds
        return None

    @property
    def ranks(self) -> int:
        """Data-parallel ranks that ran (run.json), else the preset's; 1 for a single process."""
        for value in ((self.run or {}).get("ranks"), self.setting("train", "ranks")):
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
        return 1

    @property
    def samples_per_s(self) -> float | None:
        """Training segments a second: steps/s x the effective batch (micro-batch x accumulation x
        ranks), the figure that compares tiers of other batches and ranks."""
        micro, accum = self.batch
        if self.steps_per_s is None or not micro:
            return None
        return self.steps_per_s * micro * (accum or 1) * self.ranks

    def setting(self, section: str, key: str):
        """A preset field, else what run.json or the estimate recorded for it."""
        if self.preset is not None:
            return self.preset[section].get(key)
        for record in (self.run, self.estimate):
            if record and record.get(key) is not None:
                return record[key]
        return None

    @property
    def attention_backend(self) -> str | None:
        """The kernel that ran (run.json), else the one the estimate modelled, else the preset's."""
        for record in (self.run, self.estimate):
            if record and record.get("attention_backend"):
                return str(record["attention_backend"])
        return self.setting("model", "attention_backend")

    @property
    def parameters(self) -> int | None:
        for record in (self.estimate, self.run):
            if record and record.get("parameters") is not None:
                return int(record["parameters"])
        return None

    @property
    def segment_seconds(self) -> float | None:
        if self.preset is None:
            return None
        audio = self.preset["audio"]
        return audio["segment_samples"] / audio["sample_rate"]

    @property
    def batch(self) -> tuple[int | None, int | None]:
        """(micro-batch, accumulation) that ran (run.json or failure.json: an OOM retry halves the
        micro-batch) or else the preset's."""
        for record in (self.run, self.failure):
            if record and record.get("batch_size"):
                return record["batch_size"], record.get("grad_accum")
        return self.setting("train", "batch_size"), self.setting("train", "grad_accum")


FIT_MATRIX = "fit_matrix"  # results/vram/fit_matrix.json: not a tier's estimate


@dataclass
class Collected:
    tiers: list[Tier]
    facts: dict
    fit_matrix: dict | None = None  # results/vram/fit_matrix.json: what fits which GPU
    search: object | None = None  # tiersep.report.search.Study: results/search/<study>/, when it exists


# ---- readers ---------------------------------------------------------------------------------
def _reader(problems: list[str]):
    """read(kind, path) -> the validated record, or None (absent, or unreadable: then the one-line
    reason is added to `problems`)."""
    def read(kind: str, path: Path) -> dict | None:
        try:
            return read_record(kind, path)
        except RecordError as err:
            problems.append(str(err))
            return None
    return read


def _number(text: str | None) -> float | None:
    if text is None or text.strip() == "":
        return None
    try:
        return float(text)
    except ValueError:
        return None  # e.g. 'nan' is fine (float parses it), anything else is not a number


def read_csv(path: Path) -> list[dict]:
    """Rows of a numeric CSV (metrics.csv, memory.csv) as {column: float | None}.

    A file the trainer cannot have written (not UTF-8 text, NUL bytes, no `step` column, a step
    that is not a finite number) raises ReportInputError naming the file: one line for the
    failures table, never a crash of the report. Other cells may be empty or 'nan' (a diverged
    loss is logged as nan)."""
    if not path.is_file():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ReportInputError(f"{path}: not a CSV the trainer wrote (not UTF-8 text: {err.reason} "
                               f"at byte {err.start})") from None
    except OSError as err:
        raise ReportInputError(f"{path}: cannot be read ({err.strerror or err})") from None
    if "\x00" in text:  # csv accepts NUL since Python 3.11; a half-written block on a crashed disk
        raise ReportInputError(f"{path}: not a CSV the trainer wrote (NUL byte at offset {text.index(chr(0))})")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    try:
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise ReportInputError(f"{path}: expected a CSV header with a 'step' column")
        for row in reader:
            values = {key: _number(value) for key, value in row.items() if key is not None}
            step = values["step"]
            if step is None or not math.isfinite(step):
                raise ReportInputError(f"{path}: line {reader.line_num}: step {row['step']!r} is not a "
                                       "finite number")
            rows.append(values)
    except csv.Error as err:  # e.g. a field over csv's size limit
        raise ReportInputError(f"{path}: line {reader.line_num}: not a CSV the trainer wrote ({err})") from None
    return rows


def _preset_for(name: str, kind: str, cfg: dict, run: dict | None) -> tuple[dict | None, str | None]:
    """The preset a tier ran with: the config's preset, else what run.json holds."""
    if run and isinstance(run.get("preset"), dict):
        return run["preset"], None
    if kind == "found":
        return None, None  # not in the current config: show only what its records say
    try:
        return C.load_preset(name, cfg), None
    except (C.ConfigError, OSError, UnicodeDecodeError) as err:  # a binary preset is a bad preset
        return None, str(err)


def tier_names(cfg: dict, results_dir: Path) -> list[tuple[str, str]]:
    """(name, kind) for every row: config tiers, estimate-only tiers, then anything else found
    under results_dir (e.g. a tier no longer in the config), in that order. A search's trials are
    the Search section's (results/search/<study>/), not rows here."""
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(name: str, kind: str) -> None:
        if name not in seen:
            seen.add(name)
            rows.append((name, kind))

    for name in C.tier_names(cfg["tiers"]):
        add(name, "tier")
    for name in C.tier_names(cfg["estimate_tiers"]):
        add(name, "estimate")
    found = {p.stem for p in (results_dir / "vram").glob("*.json")} - {FIT_MATRIX}
    for stage in ("train", "eval"):
        found |= {p.name for p in (results_dir / stage).glob("*") if p.is_dir() and not p.name.startswith(".")}
    for name in sorted(found):
        add(name, "found")
    return rows


def collect_tier(name: str, kind: str, cfg: dict, results_dir: Path) -> Tier:
    train_dir = results_dir / "train" / name
    problems: list[str] = []
    read = _reader(problems)
    run = read("run", train_dir / "run.json")
    preset, preset_error = _preset_for(name, kind, cfg, run)
    recovered = (run or {}).get("recovered_from")
    logs = {}
    for log in ("metrics", "memory"):
        try:
            logs[log] = read_csv(train_dir / f"{log}.csv")
        except ReportInputError as err:
            problems.append(str(err))
            logs[log] = []
    listen, listen_error = None, None
    try:
        listen = read_listen(results_dir / "eval" / name / "listen")
    except RecordError as err:
        listen_error = str(err)
        problems.append(listen_error)
    # The trainer removes failure.json when an attempt starts training, so one that is present
    # describes the last attempt; an OOM that a retry got past is recorded in run.json instead.
    return Tier(name=name, kind=kind, preset=preset, preset_error=preset_error,
                estimate=read("estimate", results_dir / "vram" / f"{name}.json"), run=run,
                failure=read("failure", train_dir / "failure.json"),
                earlier_failure=recovered if isinstance(recovered, dict) else None,
                metrics=logs["metrics"], memory=logs["memory"],
                scores=read("scores", results_dir / "eval" / name / "scores.json"), listen=listen,
                listen_error=listen_error, problems=problems)


# ---- run facts ---------------------------------------------------------------------------------
def config_hash(cfg: dict) -> str:
    """Hash of the effective config (defaults filled, private keys dropped)."""
    public = {k: v for k, v in cfg.items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode()).hexdigest()[:12]


def git_commit(where: Path | None = None) -> str:
    """HEAD of the git work tree containing `where` (default: the working directory), '+dirty' when
    tracked files differ from it; 'unknown' outside a repository or without git."""
    cwd = str(where) if where else None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = head.stdout.strip()[:12]
    return commit + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def manifest_summary(path: Path, manifest: dict) -> dict:
    """A short, format-tolerant summary of a prepared dataset manifest."""
    summary: dict = {"path": str(path)}
    for key in ("source", "sample_rate", "channels", "root", "created", "version"):
        if manifest.get(key) is not None:
            summary[key] = manifest[key]
    if isinstance(manifest.get("stems"), list):  # prepare writes the files of a track, mixture first
        summary["stems"] = ", ".join(str(s) for s in manifest["stems"] if s != "mixture")
    rate = manifest.get("sample_rate")
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}
    tracks = manifest.get("tracks")
    if isinstance(tracks, dict):  # {split: [track, ...]} or {name: {split, samples}}
        items = []
        for key, value in tracks.items():
            if isinstance(value, list):
                items += [{"split": key, **(t if isinstance(t, dict) else {"name": t})} for t in value]
            elif isinstance(value, dict):
                items.append({"name": key, **value})
        tracks = items
    if isinstance(tracks, list):
        for track in tracks:
            if not isinstance(track, dict):
                continue
            split = str(track.get("split", "all"))
            counts[split] = counts.get(split, 0) + 1
            samples = track.get("samples") or track.get("length")
            if samples and rate:
                seconds[split] = seconds.get(split, 0.0) + float(samples) / float(rate)
    elif isinstance(manifest.get("splits"), dict):
        for split, names in manifest["splits"].items():
            counts[str(split)] = len(names) if isinstance(names, (list, dict)) else int(names)
    if "train" in seconds:
        summary["train_seconds"] = seconds["train"]
    if counts:
        summary["tracks"] = ", ".join(
            f"{split} {n}" + (f" ({seconds[split]:.0f} s)" if split in seconds else "")
            for split, n in counts.items())
    skipped = manifest.get("skipped")
    if isinstance(skipped, (list, dict)):
        summary["skipped"] = len(skipped)
    return summary


def dataset_manifests(cfg: dict, problems: list[str]) -> list[dict]:
    """Summaries of <prepared_dir>/<source>/<rate>/manifest.json for every rate prepared; a
    manifest that breaks its schema is a problem instead."""
    base = Path(cfg["data"]["prepared_dir"]) / cfg["data"]["source"]
    read = _reader(problems)
    out = []
    for path in sorted(base.glob("*/manifest.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        manifest = read("manifest", path)
        if manifest is not None:
            out.append(manifest_summary(path, manifest))
    return out


def run_facts(cfg: dict, results_dir: Path, tiers: list[Tier]) -> dict:
    versions: dict[str, list[str]] = {}  # one entry per distinct version set, with its tiers
    for tier in tiers:
        record = (tier.run or {}).get("versions")
        if isinstance(record, dict):
            key = ", ".join(f"{k} {v}" for k, v in record.items() if v is not None)
            versions.setdefault(key, []).append(tier.name)
    devices = []
    for tier in tiers:
        if tier.run is None and tier.failure is None:
            continue
        record = tier.failure or tier.run  # the last attempt
        devices.append({"tier": tier.name, "device": tier.measured_device or "unknown",
                        "host": record.get("host"), "pid": record.get("pid"),
                        "slurm_job_id": record.get("slurm_job_id"),
                        "start_free_bytes": record.get("start_free_bytes")})
    problems: list[str] = []
    return {
        "config_hash": config_hash(cfg),
        "config_source": cfg.get("_source"),
        "git_commit": git_commit(),
        "results_dir": str(results_dir),
        "budget_bytes": C.budget_bytes(cfg) if cfg.get("budget_gib") != "auto" else None,
        "budget_setting": cfg.get("budget_gib"),
        "estimate_settings": cfg.get("estimate", {}),
        "versions": versions,
        "devices": devices,
        "datasets": dataset_manifests(cfg, problems),
        "problems": problems,  # records outside any tier (manifests) that could not be read
    }


def collect(cfg: dict, results_dir: str | Path) -> Collected:
    results_dir = Path(results_dir)
    tiers = [collect_tier(name, kind, cfg, results_dir) for name, kind in tier_names(cfg, results_dir)]
    facts = run_facts(cfg, results_dir, tiers)
    # a damaged matrix is a problem of the run (an invalid-record row), the page renders without it
    fit_matrix = _reader(facts["problems"])("fit_matrix", results_dir / "vram" / f"{FIT_MATRIX}.json")
    from tiersep.report.search import collect_study

    return Collected(tiers=tiers, facts=facts, fit_matrix=fit_matrix,
                     search=collect_study(cfg, results_dir, facts["problems"]))
