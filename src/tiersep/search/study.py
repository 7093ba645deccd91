"""The Optuna study a search owns: storage, directions, sampler and pruner from `search:`.

Storage: a journal file results/search/<study>/journal.log by default (safe for many processes on
one host, not over NFS across hosts); a URL with `://` (postgresql://..., Optuna's RDB storage)
is handed to Optuna as it is. The study remembers its space, objectives and base preset, so a rerun
with other settings under the same name is refused instead of mixing two searches.
"""
from __future__ import annotations

import json
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from tiersep import config as C

from .space import Dimension, grid

DIRECTIONS = {"si_sdr": "maximize", "predicted_peak": "minimize"}
REDUCTION_FACTOR = 3   # Hyperband's and ASHA's eta: keep the best third at each rung


def storage(url: str | None, folder: Path):
    """The study's storage: a journal file (default or a path), or an RDB URL given to Optuna."""
    if url and "://" in url:
        return url
    path = Path(url) if url else folder / "journal.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its study.stop() once the grid is used up: stop() raises outside
    study.optimize, so it killed the orchestrator at the last grid point's tell (ask-and-tell). The
    orchestrator ends the study itself, after min(trials, grid size) trials."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def sampler(search: dict, dims: dict[str, Dimension], source: str, offset: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler, seeded with search.seed + `offset` (see reseed); the grid sampler with search.seed alone."""
    name, seed = search["sampler"], search["seed"] + offset
    if name == "nsga2" and len(search["objectives"]) < 2:
        raise C.ConfigError(f"{source}: search.sampler: nsga2 needs two objectives "
                            "(search.objectives: [si_sdr, predicted_peak])")
    if name == "grid":   # trial n takes point n of the grid shuffled by the seed: one seed for every ask
        return AskTellGridSampler(grid(dims, source), seed=search["seed"])
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def reseed(study: optuna.Study, search: dict, dims: dict[str, Dimension], source: str) -> None:
    """A fresh sampler seeded by how many trials the study holds, before each ask: orchestrators
    sharing a study would otherwise draw the same random numbers from the same seed, and a study is
    then reproducible from its history whoever asks (the samplers keep their state in the storage)."""
    study.sampler = sampler(search, dims, source, offset=len(study.get_trials(deepcopy=False)))


def prunes(search: dict) -> bool:
    """Whether intermediate values are reported and pruned on: Optuna prunes single-objective studies only."""
    return search["pruner"] != "none" and len(search["objectives"]) == 1


def pruner(search: dict, base: dict) -> optuna.pruners.BasePruner:
    """The pruner; its resource is the training step, its first rung the first validation."""
    if not prunes(search):
        return optuna.pruners.NopPruner()
    steps = base["train"]["steps"]
    if "train.steps" in search["space"]:
        spec = search["space"]["train.steps"]
        steps = max(spec.get("choices") or [spec.get("high", steps)])
    first = base["train"]["validate_every"]
    if "train.validate_every" in search["space"]:
        spec = search["space"]["train.validate_every"]
        first = min(spec.get("choices") or [spec.get("low", first)])
    name = search["pruner"]
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=REDUCTION_FACTOR)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=first)
    return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=max(steps, first),
                                          reduction_factor=REDUCTION_FACTOR)


def fingerprint(search: dict, base: dict) -> str:
    """What makes two runs the same study: the space, the objectives and the base preset."""
    return json.dumps({"space": search["space"], "objectives": search["objectives"],
                       "preset": C.preset_hash({k: v for k, v in base.items() if k != "name"})},
                      sort_keys=True)


def open_study(search: dict, base: dict, dims: dict[str, Dimension], folder: Path, source: str,
               storage_url: str | None = None) -> optuna.Study:
    """Create the study, or load it when the same command ran before (the resume)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=search["study"], storage=storage(storage_url or search["storage"], folder),
        sampler=sampler(search, dims, source), pruner=pruner(search, base),
        directions=[DIRECTIONS[o] for o in search["objectives"]], load_if_exists=True)
    mine = fingerprint(search, base)
    theirs = study.user_attrs.get("fingerprint")
    if theirs is None:
        study.set_user_attr("fingerprint", mine)
    elif theirs != mine:
        raise C.ConfigError(f"{source}: search.study: {search['study']} already holds a search with another "
                            "space, objectives or base preset; give another --study (or remove its folder)")
    return study
