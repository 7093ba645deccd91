"""Constants shared by the estimate methods (trace, analytic, measure), the gate and the report.

The CUDA context and library workspaces are not here: they are measured per GPU and come from a
device calibration (tiersep.memory.calibration).
"""
from __future__ import annotations

MIB = 2**20
GIB = 2**30

# The parts of an estimate's peak_bytes, in the order the report shows them.
BREAKDOWN_KEYS = ("weights", "gradients", "optimizer", "activations", "transient", "overhead")

# Relative uncertainty stated with a trace estimate: what the accuracy record against real
# measurements supports, not a safety margin. A CUDA training estimate states its class's instead
# (memory/accuracy.py, from the GPU evidence); this one is the inference estimate's (memory/inference.py).
CUDA_UNCERTAINTY = 0.015
CPU_UNCERTAINTY = 0.03
