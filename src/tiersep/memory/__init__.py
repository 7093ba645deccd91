"""Peak-memory estimates of a training step (and of a separation call), and the budget decisions.

estimate(preset, method, device, budget_bytes, safety_margin) -> the results/vram JSON record
fit(preset, budget_bytes, device, settings) -> (variant that fits, changes)
gate(preset, device_type, budget_bytes, settings, estimate=None) -> estimate, or DoesNotFit
GateSettings(safety_margin, calibration_spec): the settings of both, GateSettings.from_config(cfg)

Three rooms, each using only the ones above it in this list:
trace/         the engine: a step on fake tensors, counted and replayed through the caching allocator
               model (its own file map in trace/__init__.py); used through that face
estimate.py    the estimate record: one method (trace, analytic, measure), the conditions it models
               (conditions.py), its class's uncertainty (accuracy.py), the CPU booking (cpu_booking.py)
conditions.py  what an estimate models, decided once: device, dtype, attention kernel, allocator
               mode, compiled, ranks, and on CUDA the card (tiersep.gpu_catalogue)
analytic.py    the `analytic` method: a closed form fitted to traces (analytic_calibration.json)
measure.py     the `measure` method: real steps on the device
inference.py   the estimate of one separation call (`tiersep separate`, `tiersep estimate --inference`)
calibration.py a device's measured constants (CUDA context, cuBLAS workspace): calibrations/*.json
accuracy.py    each class's uncertainty, from the GPU evidence (evidence.py writes accuracy_evidence.json)
cpu_booking.py what a CPU train process occupies beyond its live tensors: the CPU gate's booking
constants.py   units and record keys shared by the rooms
fit/           the budget decisions: gate, the fit search, the fit matrix, the cost of a change

`tiersep.memory.fit` and `.gate` as attributes are the functions exported here, not the modules:
import a module of the fit room with `from tiersep.memory.fit import matrix`, not
`import tiersep.memory.fit.matrix` (whose attribute lookup finds the function).
"""
from .estimate import estimate
from .fit import DoesNotFit, GateSettings, NothingFits, fit, gate

__all__ = ["estimate", "fit", "gate", "DoesNotFit", "GateSettings", "NothingFits"]
