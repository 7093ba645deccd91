"""Evaluation: chunked overlap-add separation (separate.py), SI-SDR and the SiSEC SDR (metrics.py),
museval scoring in worker processes (scoring.py) and `tiersep evaluate` (run.py).

Nothing is imported here so that museval workers, which import tiersep.evaluate.scoring, stay free
of torch.
"""
