"""glibc's malloc, controlled at run time: the tuned mode's thresholds and giving the heap back.

- `configure_malloc()`: the tuned mode: a fixed 64 KiB mmap threshold, so freed tensor buffers go
  back to the kernel instead of leaving holes in a heap that only shrinks from the top. Without it
  a checkpointed step's RSS grew 1.8-2x its live bytes instead of ~1.1x. It costs page faults on
  every tensor: cpu_small trained at 0.33 instead of 1.31 steps/s. The trainer calls it only when
  the estimate chose the tuned mode (memory/cpu_booking.py), before the model exists, and records
  the mode in run.json; `tiersep separate` likewise.
- `trimmed_heap()`, `release_heap()`: malloc_trim(0), around each checkpointed block and after a run.
Everything here is a no-op off Linux glibc, saying so.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys

KIB = 2**10

# glibc: buffers of at least MMAP_THRESHOLD bytes are mmap'ed and unmapped on free. Setting it
# explicitly also turns off glibc's dynamic threshold (which otherwise climbs to 32 MiB after the
# first large free and then serves every tensor below that from a heap that never shrinks).
MMAP_THRESHOLD = 64 * KIB
TRIM_THRESHOLD = 128 * KIB     # glibc's own default, pinned so the dynamic rule cannot raise it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt parameter numbers (malloc.h)


def malloc_env() -> dict[str, str]:
    """The environment variables that give a new process the settings configure_malloc() applies."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def _libc_function(name: str):
    """The C library's function `name` (glibc's on Linux), or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def configure_malloc() -> dict:
    """Apply the malloc settings the booking assumes to this process (glibc only); returns what was
    set, for run.json. Later allocations follow them, so calling it before the model exists is enough."""
    if not sys.platform.startswith("linux"):
        return {"allocator": sys.platform, "applied": False, "reason": "not Linux glibc"}
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return {"allocator": "unknown libc", "applied": False, "reason": "no mallopt in the C library"}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return {"allocator": "glibc", "applied": bool(ok), "mmap_threshold": MMAP_THRESHOLD,
            "trim_threshold": TRIM_THRESHOLD, **({} if ok else {"reason": "mallopt refused"})}


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None off glibc."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@contextlib.contextmanager
def trimmed_heap():
    """Give the whole free pages inside glibc's heap back to the kernel (malloc_trim(0)), then run
    the block. The trainer wraps each checkpointed block's forward and recomputation in it with
    glibc's own malloc (TFLocoformer.checkpoint_context): each recomputation frees and reallocates
    a block's activations, and the holes the last one left, fenced by small C++ objects, could not
    take the next one's (posix_memalign asks more than an exact hole), so the heap grew by about a
    block per block: r21_10 with 4 layers peaked at 4298-4540 MiB, and at 2904-2944 with the trim.
    It costs ~10% of a checkpointed step (the pages are faulted in again). A no-op off glibc."""
    release_heap()
    yield


def release_heap() -> None:
    """malloc_trim(0): give the whole free pages inside glibc's heap back to the kernel. The trainer
    calls it once more after a run, its model freed (trainer.train), so that the library pages the
    exit touches take their room and the booking counts them once. A no-op off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
