"""tiersep: train TF-Locoformer separators at several GPU-memory tiers."""
__version__ = "0.1.0"
