"""TF-Locoformer for stereo multi-source separation, its loss, its STFT and its compile helper."""
from .compile import compile_model
from .loss import SeparationLoss, build_loss
from .tflocoformer import TFLocoformer, build_model, count_parameters

__all__ = ["TFLocoformer", "build_model", "count_parameters", "build_loss", "SeparationLoss", "compile_model"]
