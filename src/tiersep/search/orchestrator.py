"""The one process that owns a study: ask, admit, launch, report, prune, tell (Optuna ask-and-tell).

For each asked trial: build its preset, admit it (admit.py: the trainer's fit gate, before any
process starts), then
- infeasible: told at once (COMPLETE with a violated constraint, value -inf) with its reason; no
  process, no run folder;
- fits or repaired: its preset and estimate are written beside its run folder, and `tiersep train`
  runs it (trial_process.py). Each validation SI-SDR in metrics.csv is reported to the trial as it
  appears; when the pruner says stop, the trial gets SIGUSR1, checkpoints, exits 75, and is told
  PRUNED ("pruned at step S"); a finished run is told COMPLETE with its last validation SI-SDR.
On a GPU the trial is placed first (packing.py): it books its predicted memory on a GPU and waits
while no GPU takes it; its process inherits the booking.

Resumable: the storage holds every decision. A rerun of the same command finds the trials a dead
orchestrator left RUNNING: one that was being pruned is told PRUNED, one whose run finished is
collected, any other is started again with --resume (from its checkpoint, or from scratch when
none was written). A trial killed while it was being sampled (params incomplete) is told FAIL with
that reason and its params re-enqueued; such a FAIL does not count, so the study ends with exactly
`trials` trials COMPLETE, PRUNED, INFEASIBLE or FAIL for another reason.

Several orchestrators may share one study (PostgreSQL across hosts, or SLURM jobs with
--single-trial): each trial records its owner and a heartbeat, asking and taking over happen under
one lock, and only a trial whose owner is gone is taken over (owners.py).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tiersep import config as C
from tiersep import gpu_lease
from tiersep.io import write_json, write_text

from . import outputs, owners, table, trial_process
from .admit import Admission, Admitter, budget_bytes, estimate_device
from .packing import Placer
from .space import grid_size, parse_space, trial_preset
from .study import open_study, prunes, reseed

GIB = 2**30
CONSTRAINT = "memory_gib"   # booking + margin - budget, in GiB (> 0: infeasible)
MAX_LAUNCHES = 3            # a trial stopped from outside (exit 75) is resumed at most this often


@dataclass
class Running:
    trial: optuna.trial.Trial
    process: object             # subprocess.Popen
    run_dir: Path
    log: Path
    started: float
    prune_step: int | None = None


class Search:
    def __init__(self, cfg: dict, study: str | None = None, trials: int | None = None,
                 parallel: int | None = None, storage: str | None = None, single: bool = False):
        self.cfg, self.source = cfg, cfg.get("_source", "config")
        if not cfg.get("search"):
            raise C.ConfigError(f"{self.source}: search: not set (give a base preset and a space; docs/search.md)")
        self.search = dict(cfg["search"])
        for key, value in (("study", study), ("trials", trials), ("parallel", parallel)):
            if value is not None:
                self.search[key] = value
        self.base = C.load_preset(self.search["preset"], cfg)
        self.dims = parse_space(self.search, self.base, self.source)
        self.fields = list(self.dims)
        self.objectives = self.search["objectives"]
        self.prunes = prunes(self.search)
        self.folder = Path(cfg["results_dir"]) / "search" / self.search["study"]
        self.trials_dir = self.folder / "trials"
        self.device = estimate_device(self.base)
        self.budget = budget_bytes(self.search, cfg, self.device, self.source)
        self.total = self.search["trials"]
        if self.search["sampler"] == "grid":
            self.total = min(self.total, grid_size(self.dims, self.source))
        self.storage_url = storage
        self.single, self.launched = single, False   # --single-trial: a worker that runs one trial and ends
        self.admitter = Admitter(cfg, self.search, self.device, self.budget)
        self.running: dict[int, Running] = {}
        gpus = gpu_lease.visible_gpus() if self.device == "cuda" else []
        self.placer = Placer(gpus, self.say) if gpus else None   # None: a CPU, or no GPU NVML can see
        self._prepared: dict[int, Path] = {}

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        url = self.storage_url or self.search["storage"]
        self.lock = owners.StudyLock(url, self.folder, self.search["study"], self.source)
        try:
            with self.lock:   # two orchestrators starting together create one study (and RDB schema)
                self.study = open_study(self.search, self.base, self.dims, self.folder, self.source,
                                        self.storage_url)
            self.owner = owners.me()
            self.heart = owners.Heartbeat(self.search["heartbeat_seconds"] / 3)
            self.heart.start()
            self.say(f"study {self.search['study']}: {self.total} trials, {self.search['sampler']} sampler, "
                     f"{self.search['pruner'] if self.prunes else 'no'} pruner, budget {self.budget / GIB:.2f} "
                     f"GiB ({self.device}), {self.search['parallel']} at once"
                     f"{', one trial in this process' if self.single else ''}; storage in {self.folder}")
            if self.placer:
                self.placer.reset_baselines()
            self.loop()
        finally:
            if hasattr(self, "heart"):
                self.heart.stop()
            self.lock.close()
        self.write_outputs()
        return self.end_of_study()

    def loop(self) -> None:
        """Run trials until the study holds `trials` of them; with other orchestrators on the same
        study, wait for theirs too and take over any they abandon (owners.py). An admitted trial
        waiting for a GPU to take its booking (packing.py) holds its slot."""
        every, checked = self.search["heartbeat_seconds"] / 3, -math.inf
        while True:
            if time.monotonic() - checked >= every:
                self.take_over()
                checked = time.monotonic()
            while self.free_slots() and self.claim_next():
                pass
            self.place()
            if not self.running and not self.waiting():
                counted, running = self.census()
                if self.single and (self.launched or counted + running >= self.total):
                    break
                if running == 0 and counted >= self.total:
                    break
            for number in list(self.running):
                self.poll(self.running[number])
            time.sleep(self.search["poll_seconds"])

    def free_slots(self) -> int:
        """Trials this process may still start now: `parallel` at once, or one in all with --single-trial."""
        if self.single:
            return 0 if self.launched or self.running or self.waiting() else 1
        return self.search["parallel"] - len(self.running) - self.waiting()

    def waiting(self) -> int:
        """Admitted trials waiting for a GPU to take their booking."""
        return len(self.placer.waiting) if self.placer else 0

    def mine(self, number: int) -> bool:
        """Whether this process runs trial `number`, or holds it waiting for a GPU."""
        held = self.placer.waiting if self.placer else []
        return number in self.running or any(w.trial.number == number for w in held)

    def place(self) -> None:
        if self.placer:
            for waiting, booking in self.placer.place(idle=not self.running):
                self.spawn(waiting.trial, waiting.admission, waiting.resume, booking)

    def census(self) -> tuple[int, int]:
        """(trials that ended and count towards `trials`, trials RUNNING under any orchestrator);
        a FAIL re-enqueued after a crash does not count."""
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                               TrialState.FAIL, TrialState.RUNNING))
        running = sum(1 for t in trials if t.state == TrialState.RUNNING)
        return sum(1 for t in trials if t.state != TrialState.RUNNING and not t.user_attrs.get("requeued")), running

    def claim_next(self) -> bool:
        """Ask a new trial and own it, when the study still lacks one (atomic across orchestrators)."""
        with self.lock:
            counted, running = self.census()
            if counted + running >= self.total:
                return False
            reseed(self.study, self.search, self.dims, self.source)
            trial = self.study.ask({k: d.distribution() for k, d in self.dims.items()})
            owners.claim(trial, self.owner)
        self.heart.add(trial)
        self.start_trial(trial)
        return True

    def take_over(self) -> None:
        """Own and recover RUNNING trials whose orchestrator is gone (owners.abandoned), up to the
        free slots; under the lock, so two orchestrators never take the same one."""
        taken = []
        with self.lock:
            for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if len(taken) >= self.free_slots() or self.mine(frozen.number):
                    continue
                why = owners.abandoned(frozen.user_attrs, self.owner, self.search["heartbeat_seconds"])
                if why is not None:
                    trial = optuna.trial.Trial(self.study, frozen._trial_id)
                    owners.claim(trial, self.owner)
                    self.heart.add(trial)
                    taken.append((frozen, why))
        for frozen, why in taken:
            self.say(f"trial {frozen.number}: taking it over: {why}")
            self.recover(frozen)

    def start_trial(self, trial: optuna.trial.Trial, resume: bool = False) -> None:
        name = f"{self.search['study']}-trial{trial.number}"
        try:
            preset = trial_preset(self.base, trial.params, name, f"{self.source} (search trial {trial.number})")
        except C.ConfigError as err:   # a combination the preset's cross-field rules refuse
            self.finish(trial, TrialState.FAIL, f"invalid preset: {C.escape_line_breaks(str(err))}")
            return
        admission = self.admitter.admit(preset)
        self.record_admission(trial, admission)
        if admission.verdict == "infeasible":
            self.tell_infeasible(trial, admission)
            return
        self.launch(trial, admission, resume)

    def record_admission(self, trial, a: Admission) -> None:
        trial.set_user_attr("verdict", a.verdict)
        trial.set_user_attr("estimate_bytes", int(a.estimate["peak_bytes"]))
        trial.set_user_attr("booking_bytes", a.booking_bytes)
        trial.set_user_attr("budget_bytes", a.budget_bytes)
        if a.levers:
            trial.set_user_attr("levers", a.levers)
            trial.set_user_attr("effective_batch", a.preset["train"]["batch_size"] * a.preset["train"]["grad_accum"])

    def tell_infeasible(self, trial, a: Admission) -> None:
        trial.set_user_attr("reason", a.reason)
        trial.set_user_attr("train_seconds", 0.0)
        trial.set_constraint(CONSTRAINT, max(a.violation_gib, 1e-9))
        self.study.tell(trial, self.values(-math.inf, a.booking_bytes), state=TrialState.COMPLETE)
        self.say(f"trial {trial.number}: INFEASIBLE, no process started: {a.reason}")
        self.write_outputs()

    def values(self, si_sdr: float, booking: int) -> list[float]:
        return [si_sdr, booking / GIB] if len(self.objectives) == 2 else [si_sdr]

    # ---- a trial's process --------------------------------------------------------------------
    def paths(self, number: int) -> tuple[Path, Path, Path, Path]:
        """(run folder, preset YAML, estimate JSON, log) of trial `number`; the run folder holds only
        what the trainer writes, the rest lies beside it."""
        d = self.trials_dir
        return d / str(number), d / f"{number}.preset.yaml", d / f"{number}.estimate.json", d / f"{number}.log"

    def data_for(self, preset: dict) -> Path:
        """The prepared folder of the trial's sample rate, as the workflow names it (prepared once)."""
        rate = preset["audio"]["sample_rate"]
        if rate not in self._prepared:
            from tiersep.data.prepare import prepare

            folder = Path(self.cfg["data"]["prepared_dir"]) / self.cfg["data"]["source"] / str(rate)
            prepare(self.cfg, folder, rate, progress=False)
            self._prepared[rate] = folder
        return self._prepared[rate]

    def launch(self, trial, a: Admission, resume: bool) -> None:
        run_dir, preset_file, estimate_file, log = self.paths(trial.number)
        write_text(preset_file, C.dump_preset(a.preset))
        write_json(estimate_file, {**a.estimate, "preset": a.preset["name"]})
        self.launched = True
        if self.placer:
            self.placer.queue(trial, a, resume)
        else:
            self.spawn(trial, a, resume, None)

    def spawn(self, trial, a: Admission, resume: bool, booking: gpu_lease.Booking | None) -> None:
        run_dir, preset_file, estimate_file, log = self.paths(trial.number)
        data = self.data_for(a.preset)
        launches = int(trial.user_attrs.get("launches", 0)) + 1
        trial.set_user_attr("launches", launches)
        process = trial_process.start(self.source, preset_file, data, run_dir, estimate_file, log, resume, booking)
        if booking is not None:
            trial.set_user_attr("gpu", booking.record())
        trial.set_user_attr("pid", process.pid)
        trial.set_user_attr("pid_started", trial_process.process_started(process.pid))
        self.running[trial.number] = Running(trial, process, run_dir, log, time.monotonic())
        what = {"fits": "fits", "repaired": f"repaired ({'; '.join(a.levers)})"}[a.verdict]
        where = (f"; {booking.bytes / GIB:.2f} GiB booked on {booking.gpu.label()}"
                 + (f" after waiting {booking.waited_seconds:.1f} s" if booking.waited_seconds >= 1 else "")
                 if booking is not None else "")
        self.say(f"trial {trial.number}: {what}, booked {a.booking_bytes / GIB:.2f} GiB of "
                 f"{a.budget_bytes / GIB:.2f}{where}; {'resumed' if resume else 'started'} pid {process.pid}")

    def poll(self, r: Running) -> None:
        """Report new validations, ask the pruner, and collect the process when it has ended."""
        if self.prunes and r.prune_step is None:
            reported = r.trial.storage.get_trial(r.trial._trial_id).intermediate_values
            for step, value in trial_process.validations(r.run_dir):
                if step in reported:
                    continue
                r.trial.report(value, step)
                if r.trial.should_prune():
                    self.prune(r, step)
                    break
        code = r.process.poll()
        if code is not None:
            self.ended(r, code)

    def prune(self, r: Running, step: int) -> None:
        r.prune_step = step
        r.trial.set_user_attr("prune_step", step)   # before the signal: a crash after it still knows
        try:
            r.process.send_signal(trial_process.signal.SIGUSR1)
        except ProcessLookupError:
            pass
        self.say(f"trial {r.trial.number}: pruner stops it at step {step} (SIGUSR1)")

    def ended(self, r: Running, code: int) -> None:
        del self.running[r.trial.number]
        trial = r.trial
        seconds = float(trial.user_attrs.get("train_seconds", 0.0)) + time.monotonic() - r.started
        trial.set_user_attr("train_seconds", round(seconds, 3))
        trial.set_user_attr("exit_code", code)
        if r.prune_step is not None and code != trial_process.EXIT_OK and trial_process.run_record(r.run_dir):
            # the run had finished when the signal came (it arrived after the trainer's handler was
            # gone, so it ended the process): the trained run stands
            self.collect(trial, r.run_dir)
        elif r.prune_step is not None and code in (trial_process.EXIT_PREEMPTED, -trial_process.signal.SIGUSR1):
            trial.set_user_attr("steps", trial_process.last_step(r.run_dir))
            trial.set_user_attr("measured_peak_bytes", trial_process.measured_peak(r.run_dir))
            self.finish(trial, TrialState.PRUNED, f"pruned at step {r.prune_step}")
        elif code == trial_process.EXIT_OK:
            self.collect(trial, r.run_dir)
        elif code == trial_process.EXIT_PREEMPTED and int(trial.user_attrs.get("launches", 0)) < MAX_LAUNCHES:
            self.say(f"trial {trial.number}: stopped from outside (exit 75); resuming it")
            self.start_trial(trial, resume=True)
        elif code == trial_process.EXIT_REFUSED:   # the machine has less free than the search budget
            reason = f"refused by the trainer's own gate at start: {trial_process.last_log_line(r.log)}"
            trial.set_user_attr("reason", reason)
            trial.set_constraint(CONSTRAINT, 1e-9 + max(0.0, float(trial.user_attrs.get("booking_bytes", 0))
                                                        - float(trial.user_attrs.get("budget_bytes", 0))) / GIB)
            self.study.tell(trial, self.values(-math.inf, int(trial.user_attrs.get("booking_bytes", 0))),
                            state=TrialState.COMPLETE)
            self.say(f"trial {trial.number}: INFEASIBLE: {reason}")
            self.write_outputs()
        else:
            what = "out of memory" if code == trial_process.EXIT_OOM else f"exit {code}"
            self.finish(trial, TrialState.FAIL, f"tiersep train ended with {what}: {trial_process.last_log_line(r.log)}")

    def collect(self, trial, run_dir: Path) -> None:
        """A finished run: its last validation SI-SDR is the objective; run.json gives steps and peak."""
        record = trial_process.run_record(run_dir)
        trial.set_user_attr("measured_peak_bytes", trial_process.measured_peak(run_dir))
        trial.set_user_attr("steps", (record or {}).get("steps", trial_process.last_step(run_dir)))
        scores = trial_process.validations(run_dir)
        if not scores:
            self.finish(trial, TrialState.FAIL, "finished without a finite validation SI-SDR in metrics.csv")
            return
        step, value = scores[-1]
        trial.set_user_attr("reason", f"trained {trial.user_attrs['steps']} steps; SI-SDR at step {step}")
        self.study.tell(trial, self.values(value, int(trial.user_attrs.get("booking_bytes", 0))),
                        state=TrialState.COMPLETE)
        self.say(f"trial {trial.number}: COMPLETE, validation SI-SDR {value:.3f} dB at step {step}")
        self.write_outputs()

    def finish(self, trial, state: TrialState, reason: str) -> None:
        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=state)
        self.say(f"trial {trial.number}: {state.name}: {reason}")
        self.write_outputs()

    # ---- after a crash ------------------------------------------------------------------------
    def recover(self, frozen) -> None:
        """A trial a dead orchestrator left RUNNING (see the module docstring)."""
        trial = optuna.trial.Trial(self.study, frozen._trial_id)
        attrs = frozen.user_attrs
        # a trial process lives on its orchestrator's host (elsewhere: it got SIGUSR1 when that one died)
        if ("pid" in attrs and owners.same_host(attrs)
                and not trial_process.wait_gone(attrs["pid"], attrs.get("pid_started"))):
            self.finish(trial, TrialState.FAIL, f"its process {attrs['pid']} from before the restart did not stop")
            return
        run_dir = self.paths(frozen.number)[0]
        if set(frozen.params) != set(self.dims):   # killed while the sampler was choosing its params
            trial.set_user_attr("requeued", True)
            self.finish(trial, TrialState.FAIL, "the orchestrator died while sampling it; params re-enqueued")
            self.study.enqueue_trial(dict(frozen.params), skip_if_exists=False)
            return
        if "prune_step" in attrs:
            trial.set_user_attr("steps", trial_process.last_step(run_dir))
            trial.set_user_attr("measured_peak_bytes", trial_process.measured_peak(run_dir))
            self.finish(trial, TrialState.PRUNED, f"pruned at step {attrs['prune_step']}")
            return
        if "pid" in attrs and trial_process.run_record(run_dir) is not None:
            self.say(f"trial {frozen.number}: its run finished while the orchestrator was down; collecting it")
            self.collect(trial, run_dir)
            return
        self.say(f"trial {frozen.number}: left RUNNING by a dead orchestrator; resuming it")
        self.start_trial(trial, resume=True)

    # ---- outputs ------------------------------------------------------------------------------
    def write_outputs(self) -> None:
        table.write_trials_csv(self.study, self.fields, self.objectives, self.folder / "trials.csv")
        table.write_best(self.study, self.objectives, self.trials_dir, self.folder / "best.yaml")

    def end_of_study(self) -> int:
        """Pareto presets, each budget's best and best.json (outputs.py); then the best trial and
        each budget's best evaluated on the test set, as a tier is. 1 when an evaluation failed."""
        index = outputs.write(self.study, self.objectives, self.folder, self.cfg, self.device)
        for item in index["budgets"]:
            self.say(f"best for {item['label']}: " + (f"trial {item['trial']} ({item['si_sdr']:.3f} dB, booked "
                                                       f"{item['booking_gib']:.2f} GiB) -> {item['preset']}"
                                                       if item.get("trial") is not None else item["reason"]))
        if index["pareto"]:
            self.say(f"Pareto front: trials {', '.join(str(p['trial']) for p in index['pareto'])} -> pareto/")
        failed = []
        # --single-trial workers end together on a cluster: none evaluates (two would race for one
        # eval folder); `tiersep search` without it, once the study is whole, evaluates
        for number in outputs.to_evaluate(index) if self.search["evaluate"] and not self.single else []:
            preset = C.load_preset(str(self.trials_dir / f"{number}.preset.yaml"))
            self.say(f"evaluating trial {number} on the test set -> eval/{number}/")
            why = outputs.evaluate(self.source, self.folder, number, self.data_for(preset))
            if why:
                failed.append(why)
                self.say(why)
        outputs.write(self.study, self.objectives, self.folder, self.cfg, self.device)   # with the scores
        return 1 if failed else 0

    def say(self, text: str) -> None:
        print(f"tiersep search: {text}", file=sys.stderr, flush=True)


def run_search(cfg: dict, study: str | None = None, trials: int | None = None, parallel: int | None = None,
               storage: str | None = None, single: bool = False) -> int:
    """`tiersep search`: run (or continue) the config's search; 0 when the study holds its trials
    (with `single`: when this process's one trial has ended, or the study needs no more)."""
    return Search(cfg, study, trials, parallel, storage, single).run()
