"""Evaluation: each test track through the overlap-add engine (tiersep.separate.overlap_add), SI-SDR
and the SiSEC SDR (metrics.py), museval scoring in worker processes (scoring.py) and
`tiersep evaluate` (run.py).

Nothing is imported here so that museval workers, which import tiersep.evaluate.scoring, stay free
of torch.
"""
