"""The trace engine: a training step (or a separation call) run on fake tensors and counted, as the
CUDA caching allocator would hold it. The estimate methods (memory/estimate.py, inference.py,
analytic.py, measure.py) use it through this face.

step.py       the `trace` of one training step: record_step, repeat_steps, summarize, trace_step
tracker.py    StorageTracker: every storage the step allocates and frees, as a timeline
allocator.py  the caching allocator model the timeline is replayed through (segments, blocks)
emulation.py  CudaEmulation: CUDA's autocast policy, dropout and attention kernels on a CPU trace
cuda_autocast.py  CUDA's autocast op lists, which emulation.py applies
attention.py  the SDPA kernel CUDA picks for a preset (modelled_backend) and models of its kernels
kernels.py    CudaKernelMemory: what CUDA kernels allocate that CPU kernels do not (workspaces...)
compiled.py   the compiled (torch.compile) step: its graphs' memory, traced
ranks.py      data-parallel ranks: what DistributedDataParallel adds to a rank's step
depth.py      a deep preset's step from a trace of five blocks, each event tagged with its block
workload.py   the model, loss, optimizer and inputs a traced or measured step runs on
"""
from . import allocator, ranks
from .attention import auto_kernel, modelled_backend
from .emulation import CudaEmulation
from .kernels import CudaKernelMemory
from .step import (CUBLAS_WORKSPACE_BYTES, STEPS, RecordedStep, TraceResult, emulated, move_order, peak_from,
                   record_step, repeat_steps, summarize, trace_step)
from .tracker import FORWARD, StorageTracker, cpu_block_bytes, cuda_block_bytes
from .workload import build_workload

__all__ = ["allocator", "ranks", "auto_kernel", "modelled_backend", "CudaEmulation", "CudaKernelMemory", "CUBLAS_WORKSPACE_BYTES",
           "STEPS", "RecordedStep", "TraceResult", "emulated", "move_order", "peak_from", "record_step",
           "repeat_steps", "summarize", "trace_step", "FORWARD", "StorageTracker", "cpu_block_bytes",
           "cuda_block_bytes", "build_workload"]
