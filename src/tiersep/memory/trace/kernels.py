"""What CUDA kernels allocate that the CPU kernels do not: the trace's op model below autograd.

`CudaKernelMemory`, the tracker's op model below autograd (one aten op at a time): memory a CUDA
kernel allocates that the CPU kernel does not, and the order of its outputs: cuDNN convolution
workspaces, cuBLAS workspaces (one per thread that runs a GEMM: the main thread and autograd's
device thread), cuFFT's input clones, col2im/im2col's input-sized outputs, native_dropout's mask
before its output, the in-place gradient accumulation of autograd's InputBuffer (fake tensors
are tensor subclasses, for which autograd never accumulates in place), the softmax kernels' own
temporaries (cuda/SoftMax.cu: the backward's `grad * output`, contiguous copies of their inputs) and
the contiguous copies cuBLAS GEMMs make of operands whose strides it cannot take (cuda/Blas.cpp).
"""
from __future__ import annotations

import math

import torch

def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


# aten ops that run a cuBLAS routine: the first one on a thread creates that thread's handle and
# its workspace (CUBLAS_WORKSPACE_CONFIG), which lives as long as the process.
CUBLAS_OPS = frozenset("mm addmm bmm baddbmm addbmm addmv mv dot vdot _addmm_activation".split())
MIB = 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _collapsible(sizes, strides) -> bool:
    """Whether dims (outermost first) can be viewed as one (reshape without a copy)."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return strides


def _fft_needs_copy(shape, strides, dims) -> bool:
    """_exec_fft permutes the batch dims first (by stride) and reshapes them into one: a copy
    unless they collapse."""
    dims = {d % len(shape) for d in dims}
    batch = sorted((d for d in range(len(shape)) if d not in dims), key=lambda d: -strides[d])
    return not _collapsible([shape[d] for d in batch], [strides[d] for d in batch])


def _batch_matrix_copied(t: torch.Tensor, transposed: bool, m: int, n: int) -> bool:
    """prepare_batch_matrix_for_cublas: whether cuBLAS gets a contiguous clone of batch matrix `t`."""
    st = t.stride()
    fast, lead = (2, 1) if transposed else (1, 2)
    if st[fast] == 1 and st[lead] >= max(1, m):
        return False
    if st[lead] == 1 and st[fast] >= max(1, n):
        return False
    return not (t.is_contiguous() and st[1] != 0 and st[2] != 0)


def _matrix_copied(t: torch.Tensor) -> bool:
    """prepare_matrix_for_cublas: whether cuBLAS gets a contiguous clone of matrix `t`."""
    import torch._prims_common as prims

    if prims.is_non_overlapping_and_dense_or_false(t):
        return False
    (s0, s1), (n0, n1) = t.stride(), t.shape
    return not ((s0 == 1 and s1 >= max(1, n0)) or (s1 == 1 and s0 >= max(1, n1)))


def _conv_bytes(x, w, y) -> tuple[int, int, int]:
    return _nbytes(x), _nbytes(w), _nbytes(y)



def cudnn_workspace(kind: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the workspace cuDNN's heuristics-chosen engine asks for (torch.backends.cudnn
    benchmark off). kind: fwd (x * w -> y), dgrad (dy * w -> dx) or wgrad (x, dy -> dw), named as for
    the convolution (x, w, y).

    Read off the H100 event logs in tests/data/gpu (bench/trace_vs_events.py lists every
    convolution with the workspace it got): the engines cuDNN 9 picks on Hopper stage the operands
    in the workspace, so it is about x + w + y bytes (bf16 and fp32/TF32 alike), except fp32 forward
    (x + w) and a transposed 2-D convolution's forward (a few MiB); the weight gradient adds split-K
    partial sums (1.5-4.1 MiB seen in bf16, 7.9-8.7 MiB in fp32; booked as 4 and 8 MiB). These are
    fits to what was seen, not cuDNN's rules: other GPUs and cuDNN versions pick other engines."""
    nx, nw, ny = _conv_bytes(x, w, y)
    half = x.dtype in (torch.float16, torch.bfloat16)
    staged = nx + nw + ny
    if x.dim() == 3:                        # 1-D convolutions (run as 2-D with height 1)
        if kind == "fwd":
            return staged + 147 if half else nx + nw + 16
        if kind == "dgrad":
            return staged + 147
        return staged + (4 if half else 8) * MIB
    # 2-D (the encoder and decoder, fp32)
    if kind == "fwd":
        return staged + 147 if x.shape[1] > 4 else nx + nw + 16
    if kind == "dgrad":
        return 6 * MIB
    return staged + 6 * MIB if x.shape[0] > 1 and x.shape[1] > 4 else 0


class CudaKernelMemory:
    """The StorageTracker op model for CUDA (see the module docstring and tracker.py)."""

    def __init__(self, cublas_workspace_bytes: int):
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self.workspaces_created: list[str] = []
        self._handlers = {
            "native_dropout": self._native_dropout,
            "convolution": self._convolution,
            "convolution_backward": self._convolution_backward,
            "_fft_r2c": self._fft, "_fft_c2c": self._fft, "_fft_c2r": self._fft,
            "col2im": self._col2im, "im2col": self._im2col,
            "add": self._add,
            "_safe_softmax": self._safe_softmax,
            "_softmax": self._softmax, "_log_softmax": self._softmax,
            "_softmax_backward_data": self._softmax_backward, "_log_softmax_backward_data": self._softmax_backward,
            "bmm": self._bmm, "baddbmm": self._bmm,
            "mm": self._mm, "addmm": self._mm,
        }

    def __call__(self, func, args, kwargs, outputs, tracker):
        name = func._opname
        handler = self._handlers.get(name)
        plan = handler(func, args, kwargs, outputs) if handler is not None else None
        if name in CUBLAS_OPS:
            thread = "autograd thread" if in_backward() else "main thread"
            if thread not in self.workspaces_created:
                self.workspaces_created.append(thread)
                # the handle is created after the output and the operand copies are allocated (the
                # GEMM call asks for it), and keeps its workspace
                plan = plan or [("out", i) for i in range(len(outputs))]
                at = next((i for i, step in enumerate(plan) if step[0] == "free"), len(plan))
                plan.insert(at, ("alloc", f"cublas workspace ({thread})", self.cublas_workspace_bytes,
                                 f"<cublas workspace: {thread}>"))
        return plan

    @staticmethod
    def _temporaries(plan, named_sizes):
        """Book kernel-local tensors: allocated in order, freed in reverse (C++ scope exit)."""
        named = [(name, n) for name, n in named_sizes if n > 0]
        plan += [("alloc", name, n, f"<{name}>") for name, n in named]
        return plan + [("free", name) for name, _ in reversed(named)]

    @staticmethod
    def _native_dropout(func, args, kwargs, outputs):
        return [("out", 1), ("out", 0)]        # dropout_cuda allocates the mask first

    @staticmethod
    def _workspace(plan, label, nbytes):
        if nbytes > 0:
            plan += [("alloc", label, nbytes, f"<{label}>"), ("free", label)]
        return plan

    def _convolution(self, func, args, kwargs, outputs):
        x, w, transposed = args[0], args[1], args[6]
        y = outputs[0]
        # a transposed convolution runs cuDNN's backward-data on its input
        ws = cudnn_workspace("dgrad", y, w, x) if transposed else cudnn_workspace("fwd", x, w, y)
        return self._workspace([("out", 0)], "cudnn workspace", ws)

    def _convolution_backward(self, func, args, kwargs, outputs):
        dy, x, w, transposed = args[0], args[1], args[2], args[7]
        plan = []
        if outputs[0] is not None:
            ws = cudnn_workspace("fwd", dy, w, x) if transposed else cudnn_workspace("dgrad", x, w, dy)
            plan.append(("out", 0))
            self._workspace(plan, "cudnn workspace", ws)
        if outputs[1] is not None:
            ws = cudnn_workspace("wgrad", dy, w, x) if transposed else cudnn_workspace("wgrad", x, w, dy)
            plan.append(("out", 1))
            self._workspace(plan, "cudnn workspace", ws)
        return plan

    @staticmethod
    def _fft(func, args, kwargs, outputs):
        """cuda/SpectralOps.cpp: c2r clones its input (cuFFT overwrites it); _exec_fft copies an
        input whose batch dims do not collapse into one."""
        x, dims = args[0], args[1]
        plan = [("out", 0)]
        temps = []
        if func._opname == "_fft_c2r":        # the transform runs on a contiguous clone
            temps.append(_nbytes(x))
            copy = _fft_needs_copy(x.shape, _contiguous_strides(x.shape), dims)
        else:
            copy = _fft_needs_copy(x.shape, x.stride(), dims)
        if copy:
            temps.append(_nbytes(x))
        for i, n in enumerate(temps):
            plan.append(("alloc", f"fft temp {i}", n, "<cufft input copy>"))
        for i in reversed(range(len(temps))):
            plan.append(("free", f"fft temp {i}"))
        return plan

    @staticmethod
    def _col2im(func, args, kwargs, outputs):
        """col2im_cuda: output = empty_like(input), resized down in place (the block keeps the
        input's size); input.contiguous() meanwhile."""
        x, y = args[0], outputs[0]
        plan = [("out", 0, max(_nbytes(x), _nbytes(y)))]
        if not x.is_contiguous():
            plan += [("alloc", "col2im input", _nbytes(x), "<contiguous input>"), ("free", "col2im input")]
        return plan

    @staticmethod
    def _im2col(func, args, kwargs, outputs):
        """im2col_cuda: output = empty_like(input), then resized up (a new block, the first freed)."""
        x, y = args[0], outputs[0]
        grows = _nbytes(y) > _nbytes(x)
        plan = [("alloc", "im2col first output", _nbytes(x), "<empty_like input>") if grows
                else ("out", 0, _nbytes(x))]
        if not x.is_contiguous():
            plan.append(("alloc", "im2col input", _nbytes(x), "<contiguous input>"))
        if grows:
            plan += [("out", 0), ("free", "im2col first output")]
        if not x.is_contiguous():
            plan.append(("free", "im2col input"))
        return plan

    @staticmethod
    def _safe_softmax(func, args, kwargs, outputs):
        """at::_safe_softmax (the math SDPA path) is composite below autograd (torch 2.11): softmax's
        output, then isneginf(self), all() of it over `dim` and a zero scalar, with which the
        output is filled in place where a row is all -inf. One full-size tensor: the output (the
        CPU allocator's own events of this composite, an ad hoc check: 33554432, 8388608, 8192 and
        4 bytes for an [8, 1024, 1024] fp32 input; a non-contiguous input adds softmax's copy)."""
        x, y = args[0], outputs[0]
        rows = list(x.shape)
        rows[args[1] % x.dim()] = 1
        plan = [("out", 0)]
        if not x.is_contiguous():   # host_softmax: input.contiguous()
            plan += [("alloc", "softmax input", _nbytes(x), "<softmax: contiguous input>"),
                     ("free", "softmax input")]
        plan += [("alloc", "masked", x.numel(), "<softmax: isneginf(self)>"),
                 ("alloc", "masked rows", math.prod(rows), "<softmax: masked rows>"),
                 ("alloc", "zero", y.element_size(), "<scalar>")]
        return plan + [("free", name) for name in ("zero", "masked rows", "masked")]

    def _softmax(self, func, args, kwargs, outputs):
        """softmax_cuda_out / log_softmax_cuda_out (cuda/SoftMax.cu host_softmax): the output is
        allocated first (a structured kernel), then input.contiguous() for the kernel."""
        x = args[0]
        return self._temporaries([("out", 0)], [("softmax input copy", 0 if x.is_contiguous() else _nbytes(x))])

    def _softmax_backward(self, func, args, kwargs, outputs):
        """softmax_backward_cuda_out: `Tensor tmp = grad * output;` (a full-size temporary in the
        promoted dtype, fp32 on the math SDPA path) handed to host_softmax_backward, which takes
        tmp.contiguous() and output.contiguous(); log_softmax's backward passes grad itself."""
        grad, out = args[0], args[1]
        temps = []
        if func._opname == "_softmax_backward_data":
            dtype = torch.promote_types(grad.dtype, out.dtype)
            shape = torch.broadcast_shapes(grad.shape, out.shape)
            temps.append(("softmax backward grad * output", math.prod(shape) * dtype.itemsize))
            # tmp takes grad's layout (TensorIterator): a copy when that is not contiguous
            temps.append(("softmax backward tmp copy", 0 if grad.is_contiguous() else math.prod(shape) * dtype.itemsize))
        else:
            temps.append(("log_softmax backward grad copy", 0 if grad.is_contiguous() else _nbytes(grad)))
        temps.append(("softmax backward output copy", 0 if out.is_contiguous() else _nbytes(out)))
        return self._temporaries([("out", 0)], temps)

    def _bmm(self, func, args, kwargs, outputs):
        """baddbmm_out_cuda_impl (cuda/Blas.cpp): cuBLAS's strided-batched GEMM takes each matrix with
        one unit stride and a leading dimension at least its extent; a result or operand that does
        not qualify is cloned contiguous first (the result copied back), a copy no fake tensor sees."""
        if func._opname == "bmm":
            b1, b2 = args[0], args[1]
        else:
            b1, b2 = args[1], args[2]
        result = outputs[0]
        if result.numel() == 0 or b1.shape[2] == 0:
            return [("out", 0)]
        rs, rz = result.stride(), result.shape
        temps = []
        if rs[1] == 1 and (rz[2] == 1 or rs[2] >= max(1, rz[1])):
            transposed = False
        elif rs[2] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[2])):
            transposed = True
        else:
            transposed = False
            temps.append(("bmm result copy", _nbytes(result)))
        lead = 1 if transposed else 2
        m, n = rz[2 if transposed else 1], rz[lead]
        k = (b2 if transposed else b1).shape[lead]
        first, second = (b2, b1) if transposed else (b1, b2)
        temps.append(("bmm operand copy 1", _nbytes(first) if _batch_matrix_copied(first, transposed, m, k) else 0))
        temps.append(("bmm operand copy 2", _nbytes(second) if _batch_matrix_copied(second, transposed, k, n) else 0))
        return self._temporaries([("out", 0)], temps)

    def _mm(self, func, args, kwargs, outputs):
        """addmm_out_cuda_impl / cublasCommonArgs (cuda/Blas.cpp): an operand that is neither dense
        nor a matrix with one unit stride is cloned contiguous; with a contiguous result the GEMM
        runs transposed, so mat2 is prepared first."""
        mat1, mat2 = (args[0], args[1]) if func._opname == "mm" else (args[1], args[2])
        first, second = (mat2, mat1) if outputs[0].is_contiguous() else (mat1, mat2)
        temps = [(f"mm operand copy {i}", _nbytes(t) if _matrix_copied(t) else 0)
                 for i, t in enumerate((first, second), 1)]
        return self._temporaries([("out", 0)], temps)

    @staticmethod
    def _add(func, args, kwargs, outputs):
        """autograd's InputBuffer sums two gradients for one input in place (old.add_(new)) when it
        holds the last reference to a dense `old`; for a fake tensor it never does. The tracker
        books the sum in old's block when old is freed right after the add."""
        if (func._overloadname != "Tensor" or torch.is_grad_enabled() or not in_backward()
                or kwargs.get("alpha", 1) != 1 or len(args) != 2):
            return None
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
                or old.dtype != new.dtype or outputs[0].shape != old.shape:
            return None
        import torch._prims_common as prims
        if not prims.is_non_overlapping_and_dense_or_false(old):
            return None
        # autograd also needs the last reference to old's storage: here one more is counted, that
        # of the Python storage object this query makes
        if torch._C._storage_Use_Count(old.untyped_storage()._cdata) > 2:
            return None
        return [("accumulate", 0, old)]
