"""TF-Locoformer for stereo multi-source separation, its loss and its STFT."""
from .loss import SeparationLoss, build_loss
from .tflocoformer import TFLocoformer, build_model, count_parameters

__all__ = ["TFLocoformer", "build_model", "count_parameters", "build_loss", "SeparationLoss"]
