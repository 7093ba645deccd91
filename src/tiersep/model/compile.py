"""torch.compile a model for training, and fall back to eager when compiling fails.

torch.compile is lazy: Dynamo traces and inductor generates code at the first call, and the
backward graph is only compiled at the first backward. So a failure of the compiler (an op the
backend cannot generate, a missing C++ compiler, a compiler bug) shows up in the middle of the first
training step. `compile_model` returns a wrapper that makes that first step safe:

- the first call that builds an autograd graph also runs the compiled backward once (gradients
  discarded), so that a backward failure surfaces inside the call, where it can still fall back;
- when a compiled call raises, the same call runs eagerly: if eager raises too, the error was the
  input's (a bad shape, a NaN check) and eager's error propagates unchanged; if eager succeeds, the
  compiler failed: one warning line names the cause, `info` records it, and every later call runs
  eagerly;
- out-of-memory is never retried: it propagates as it is (the trainer has its own OOM handling).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

# The `train.compile_mode` setting -> torch.compile's mode ("default" is torch's own default).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiles(preset: dict, device_type: str) -> bool:
    """Whether the trainer compiles `preset`'s model on `device_type` (train.compile). auto: on CUDA,
    except with checkpointing, where a compiled CPU step took 2.0x the eager peak and no estimate
    covers it yet (bench/results/compiled_estimate_cpu.md); never on CPU, where it does not pay
    (bench/results/model_step_cpu.md). true/false force it."""
    wanted = preset["train"].get("compile", False)
    if wanted == "auto":
        return device_type == "cuda" and not preset["model"]["checkpointing"]
    return bool(wanted)


def point_caches_at(cache_dir: Path) -> dict[str, str]:
    """Inductor's and Triton's on-disk caches under cache_dir, so later runs reuse compiled code.

    Inductor reads these variables when it first looks for a cache; set them before compiling.
    """
    paths = {"TORCHINDUCTOR_CACHE_DIR": str(Path(cache_dir) / "inductor"),
             "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton")}
    for name, path in paths.items():
        os.makedirs(path, exist_ok=True)
        os.environ[name] = path
    try:  # forget cache paths an earlier compile in this process may have resolved
        from torch._inductor.utils import clear_caches
        clear_caches()
    except ImportError:
        pass
    return paths


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].strip() if lines else ""


def error_chain(err: BaseException) -> str:
    """The cause in one line, for a warning and for info['reason']: Dynamo wraps a backend's
    error (BackendCompilerFailed ... from the real one), so the innermost cause is named too."""
    root = err
    while (root.__cause__ or getattr(root, "inner_exception", None)) is not None:
        root = root.__cause__ or root.inner_exception
    text = f"{type(err).__name__}: {first_line(err)}".rstrip(": ")
    if root is not err:
        text += f" <- {type(root).__name__}: {first_line(root)}".rstrip(": ")
    return text


def warn_stderr(message: str) -> None:
    print(f"tiersep: warning: {message}", file=sys.stderr)


class CompiledWithFallback(nn.Module):
    """Calls the compiled model; on a compiler failure switches to the eager model for good.

    `eager` is the original model (its parameters, state_dict keys and modes are the wrapper's);
    `info` is the dict compile_model returned, updated in place when a fallback happens.
    """

    def __init__(self, eager: nn.Module, compiled: Callable, info: dict,
                 warn: Callable[[str], None] = warn_stderr, before_eager: Callable[[str], None] | None = None):
        super().__init__()
        self.eager = eager
        self.compiled = compiled
        self.info = info
        self.warn = warn
        self.before_eager = before_eager   # called with the reason once a failure switches to eager
        self.backward_checked = False

    def forward(self, *args, **kwargs):
        if not self.info["compiled"]:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled_call(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - eager tells a compiler failure from a real error
            return self.fall_back(err, args, kwargs)

    def compiled_call(self, *args, **kwargs):
        out = self.compiled(*args, **kwargs)
        if not self.backward_checked and isinstance(out, torch.Tensor) and out.requires_grad:
            # The backward graph compiles at its first use: run it now, while we can fall back.
            params = [p for p in self.eager.parameters() if p.requires_grad]
            if params:
                torch.autograd.grad(out, params, grad_outputs=torch.ones_like(out), retain_graph=True,
                                    allow_unused=True)
            self.backward_checked = True
        return out

    def fall_back(self, err: Exception, args, kwargs):
        out = self.eager(*args, **kwargs)  # an error here is the input's own: it propagates
        reason = error_chain(err)
        self.info.update(compiled=False, reason=reason)
        self.warn(f"torch.compile ({self.info['backend']}, mode {self.info['mode']}) failed, "
                  f"running eager instead: {reason}")
        if self.before_eager is not None:   # e.g. the trainer's gate, re-checked for the eager step
            self.before_eager(reason)
        return out

    # The checkpoint format is the eager model's: no wrapper prefix in the keys.
    def state_dict(self, *args, **kwargs):
        return self.eager.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.eager.load_state_dict(*args, **kwargs)


def compile_model(model: nn.Module, mode: str | None = "default", cache_dir: Path | None = None, *,
                  backend: str | Callable = "inductor", fullgraph: bool = True,
                  warn: Callable[[str], None] = warn_stderr,
                  before_eager: Callable[[str], None] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """(model to call, info) with info = {compiled, mode, backend, cache_dir, reason}.

    `mode` is one of COMPILE_MODES (None = "default"). `cache_dir` (optional) holds inductor's and
    Triton's caches. Compilation errors never raise here nor at the first call: they make
    info["compiled"] False with the cause in info["reason"] and a warning, and the eager model runs;
    `before_eager(reason)` is called then (it may raise, e.g. the fit gate refusing the eager step).
    """
    mode = mode or "default"
    if mode not in COMPILE_MODES:
        raise ValueError(f"train.compile_mode: {mode!r} (allowed: {', '.join(COMPILE_MODES)})")
    info: dict[str, Any] = {
        "compiled": True, "mode": mode, "reason": None, "cache_dir": str(cache_dir) if cache_dir else None,
        "backend": backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)),
    }
    if cache_dir is not None:
        point_caches_at(cache_dir)
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=fullgraph,
                                 mode=None if mode == "default" else mode)
    except Exception as err:  # noqa: BLE001 - e.g. a backend unknown to this torch
        info.update(compiled=False, reason=error_chain(err))
        warn(f"torch.compile ({info['backend']}, mode {mode}) failed, running eager instead: "
             f"{info['reason']}")
        if before_eager is not None:
            before_eager(info["reason"])
        return model, info
    return CompiledWithFallback(model, compiled, info, warn, before_eager), info
