"""`tiersep search`: a hyperparameter search whose trials never run out of memory (docs/search.md).

One orchestrator owns an Optuna study (ask-and-tell). Every trial is estimated by the trainer's own
fit gate before any process starts: it runs, runs repaired, or is told infeasible at no cost; each
one that runs is its own `tiersep train` process, pruned through the trainer's preemption signal.

    space.py          search.space checked against the base preset; Optuna distributions
    study.py          storage, sampler, pruner; the study's fingerprint
    admit.py          the fit gate's verdict per trial: fits, repaired (levers) or infeasible
    trial_process.py  one trial's `tiersep train` process: start, metrics, stop, records
    orchestrator.py   the ask / admit / launch / report / prune / tell loop, and the resume
    owners.py         several orchestrators on one study: owners, heartbeats, the study lock
    table.py          trials.csv and best.yaml from the study's storage
    outputs.py        when the study ends: pareto/, best/<budget>gib.yaml, best.json, and the best
                      trials evaluated on the test set (eval/<n>/)
"""
from .orchestrator import Search, run_search

__all__ = ["Search", "run_search"]
