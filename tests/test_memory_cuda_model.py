"""CUDA emulation on a CPU trace: autocast policy, dropout and SDPA kernel models.

The strongest check needs no GPU: fake CUDA tensors run *forward* ops through the real AutocastCUDA
kernels (only autograd's backward needs a device), so the real model's forward under CUDA autocast on
fake CUDA tensors is the reference the emulation (fake CPU tensors + CudaEmulation) must reproduce.
"""
from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tiersep import config as C
from tiersep.memory.trace.attention import choose_cuda_backend, fused_attention
from tiersep.memory.trace.cuda_autocast import FP32, FP32_OUTPUT, LOWER_PRECISION, PROMOTE, cuda_autocast_ops, policy_of
from tiersep.memory.trace.emulation import CudaEmulation
from tiersep.memory.trace.kernels import CudaKernelMemory
from tiersep.memory.trace.tracker import FORWARD, StorageTracker, cuda_block_bytes


def small_preset(**fields):
    preset = C.load_preset("cpu_small")
    for key, value in {"audio.segment_samples": 4000, "model.n_heads": 2, "model.norm_groups": 4,
                       "model.emb_dim": 24, "model.attention_dim": 24}.items():
        preset = C.set_field(preset, key, value)
    for key, value in fields.items():
        preset = C.set_field(preset, key.replace("__", "."), value)
    return preset


def test_every_cuda_autocast_op_has_a_policy():
    registered = cuda_autocast_ops()
    missing = sorted(op for op in registered if policy_of(op) is None)
    assert not missing, f"ops with an AutocastCUDA kernel but no policy in cuda_model: {missing}"
    listed = LOWER_PRECISION | FP32 | FP32_OUTPUT | PROMOTE
    assert listed - registered == set(), f"policies for ops CUDA autocast does not touch: {listed - registered}"
    assert policy_of("__matmul__") == "lower" and policy_of("group_norm") == "fp32"
    assert policy_of("silu") is None


def _forward_allocations(preset, real_cuda: bool):
    """(peak, live at the end, multiset of (dtype, bytes)) of the model's forward with autocast."""
    from tiersep.model import build_model

    dtype = torch.bfloat16 if preset["train"]["precision"] == "bf16" else None
    with FakeTensorMode():
        device = "cuda" if real_cuda else "cpu"
        with torch.device(device):
            torch.manual_seed(0)
            model = build_model(preset).train()
        x = torch.empty(2, 2, preset["audio"]["segment_samples"], device=device)
        tracker = StorageTracker(cuda_block_bytes)
        tracker.register(list(model.parameters()) + [x])
        if real_cuda:   # CUDA autocast on fake CUDA tensors: the real AutocastCUDA kernels
            torch.set_autocast_enabled("cuda", dtype is not None)
            if dtype is not None:
                torch.set_autocast_dtype("cuda", dtype)
            try:
                with tracker:
                    tracker.phase = FORWARD
                    out = model(x)
            finally:
                torch.set_autocast_enabled("cuda", False)
        else:
            autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
            with CudaEmulation(preset["model"]["attention_backend"]), tracker, autocast:
                tracker.phase = FORWARD
                out = model(x)
        tracker.stop()
        live = tracker.live_bytes
        del out
    # tensors under 4 KiB (RoPE angle tables and the like) are left out: their count varies with
    # fake-tensor caching state from earlier tests, and their bytes are immaterial
    sizes = collections.Counter((a.dtype, a.nbytes) for a in tracker.timeline.allocations.values()
                                if a.phase == FORWARD and a.nbytes >= 4096)
    return tracker.peak_bytes, live, sizes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_emulated_forward_matches_cuda_autocast(precision):
    # math attention: the fused-kernel choice needs a real device, the math path is composite
    preset = small_preset(train__precision=precision, model__dropout=0.1, model__attention_backend="math")
    cuda_peak, cuda_live, cuda_sizes = _forward_allocations(preset, real_cuda=True)
    emu_peak, emu_live, emu_sizes = _forward_allocations(preset, real_cuda=False)
    assert emu_sizes == cuda_sizes
    # saved activations at the end of forward, and the forward peak: within 0.1%
    assert emu_live == pytest.approx(cuda_live, rel=1e-3)
    assert emu_peak == pytest.approx(cuda_peak, rel=1e-3)


def test_cpu_dropout_differs_from_cuda_without_emulation():
    """The reason dropout is emulated: CPU saves a float noise tensor where CUDA saves a bool mask."""
    preset = small_preset(model__dropout=0.1, model__attention_backend="math")
    _, cuda_live, _ = _forward_allocations(preset, real_cuda=True)
    from tiersep.model import build_model

    with FakeTensorMode():
        model = build_model(preset).train()
        x = torch.empty(2, 2, preset["audio"]["segment_samples"])
        tracker = StorageTracker(cuda_block_bytes)
        tracker.register(list(model.parameters()) + [x])
        with tracker:
            out = model(x)
        tracker.stop()
        del out
    assert tracker.live_bytes > cuda_live * 1.05


def test_fused_attention_keeps_linear_state():
    n, h, length, d = 6, 2, 300, 16
    with FakeTensorMode():
        q, k, v = (torch.empty(n, h, length, d, requires_grad=True) for _ in range(3))
        tracker = StorageTracker(cuda_block_bytes)
        with tracker:
            out = fused_attention(q, k, v, "efficient")
        tracker.stop()
    sizes = sorted(a.nbytes for a in tracker.timeline.allocations.values())
    # the output and the fp32 logsumexp (rows padded to 32); nothing of size L^2
    assert sizes == sorted([cuda_block_bytes(n * h * length * d * 4), cuda_block_bytes(n * h * 320 * 4)])
    assert out.shape == (n, h, length, d)


def test_flash_pads_head_dim_to_8():
    with FakeTensorMode():
        q, k, v = (torch.empty(4, 2, 50, 12, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        tracker = StorageTracker(cuda_block_bytes)
        with tracker:
            out = fused_attention(q, k, v, "flash")
        tracker.stop()
    shapes = {a.shape for a in tracker.timeline.allocations.values()}
    assert (4, 2, 50, 16) in shapes           # padded copies of q, k, v
    assert out.shape == (4, 2, 50, 12)


def test_backend_choice():
    assert choose_cuda_backend("auto", torch.bfloat16, 16, False) == "flash"
    assert choose_cuda_backend("auto", torch.float32, 16, False) == "efficient"
    assert choose_cuda_backend("auto", torch.float32, 6, False) == "math"
    assert choose_cuda_backend("math", torch.bfloat16, 16, False) == "math"
    with pytest.raises(ValueError, match="model.attention_backend: flash needs"):
        choose_cuda_backend("flash", torch.float32, 16, False)


# ------------------------------------------------------------------------------------------------
# Kernel-internal memory and allocation order, checked against the H100 allocator event logs
# (tests/data/gpu/h100-2026-11-22/events): the expected sizes below are read off those logs.
# ------------------------------------------------------------------------------------------------
def _trace(fn, *, workspace=32 * 2**20):
    """Run fn() on fake CPU tensors under a tracker with the CUDA op model; the (sign, bytes, op) list."""
    tracker = StorageTracker(cuda_block_bytes, op_model=CudaKernelMemory(workspace))
    with tracker:
        keep = fn()
    tracker.stop()
    del keep
    tl = tracker.timeline
    return [(s, tl.allocations[k].nbytes, tl.allocations[k].op) for k, s in tl.events]


def _backward_events(fn, **kw):
    """(sign, bytes, op) of the backward part of fn() (forward and backward run under the tracker,
    so that the tensors backward uses are known to it)."""
    tracker = StorageTracker(cuda_block_bytes, op_model=CudaKernelMemory(kw.get("workspace", 32 * 2**20)))
    with tracker:
        fn()
    tracker.stop()
    tl = tracker.timeline
    return [(s, tl.allocations[k].nbytes, tl.allocations[k].op)
            for (k, s), phase in zip(tl.events, tl.phases) if phase == "backward"]


def test_autocast_casts_the_last_argument_first():
    """The log's SwiGLU conv under bf16 autocast: +768 (bias), +147456 (weight), +17189280 (input)."""
    with FakeTensorMode():
        x = torch.empty(345, 48, 519)
        conv = torch.nn.Conv1d(48, 384, 4)

        def run():
            with CudaEmulation(), torch.autocast("cpu", dtype=torch.bfloat16):
                return conv(x)
        events = _trace(run)
    casts = [n for s, n, op in events if s > 0 and op == "_to_copy.default"]
    assert casts == [cuda_block_bytes(384 * 2), cuda_block_bytes(384 * 48 * 4 * 2), cuda_block_bytes(345 * 48 * 519 * 2)]


def test_dropout_mask_is_allocated_before_its_output():
    with FakeTensorMode():
        x = torch.empty(345, 192, 516, dtype=torch.bfloat16)
        events = _trace(lambda: torch.native_dropout(x, 0.1, True))
    assert [n for s, n, _ in events if s > 0] == [cuda_block_bytes(x.numel()), cuda_block_bytes(x.numel() * 2)]


@pytest.mark.parametrize("x_shape,w_shape,transposed,dtype,recorded", [
    # small bf16: the SwiGLU conv (48 -> 384) and deconv (192 -> 48), freq path
    ((345, 48, 519), (384, 48, 4), False, torch.bfloat16, 154056243),
    ((345, 192, 516), (192, 48, 4), True, torch.bfloat16, 85622835),
    # ultra_safe fp32: the conv forward stages only its input and weight
    ((518, 96, 1031), (768, 96, 4), False, torch.float32, 206257936),
    ((518, 384, 1028), (384, 96, 4), True, torch.float32, 1023594387),
])
def test_cudnn_workspace_is_the_recorded_one(x_shape, w_shape, transposed, dtype, recorded):
    with FakeTensorMode():
        x, w = torch.empty(x_shape, dtype=dtype), torch.empty(w_shape, dtype=dtype)
        conv = F.conv_transpose1d if transposed else F.conv1d
        events = _trace(lambda: conv(x, w))
    (_, out, _), (_, ws, op), (sign, freed, _) = events
    assert op == "<cudnn workspace>" and sign < 0 and freed == ws      # right after the output, then freed
    assert ws == cuda_block_bytes(recorded)


def test_cudnn_workspace_kinds_of_a_convolution_backward():
    """conv (48 -> 384, bf16) backward in the log: grad input + its workspace (x + w + y + 147), grad
    weight + its workspace (the recorded 155530800: x + w + y + 1474704 of split-K sums), grad bias."""
    with FakeTensorMode():
        x = torch.empty(345, 48, 519, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(384, 48, 4, dtype=torch.bfloat16, requires_grad=True)
        b = torch.empty(384, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.empty(345, 384, 516, dtype=torch.bfloat16)
        events = _backward_events(lambda: F.conv1d(x, w, b).backward(dy))
    ops = [(s, op) for s, _, op in events if s > 0]
    assert [op for _, op in ops][:5] == ["convolution_backward.default", "<cudnn workspace>",
                                         "convolution_backward.default", "<cudnn workspace>",
                                         "convolution_backward.default"]
    dgrad, wgrad = [n for s, n, op in events if s > 0 and op == "<cudnn workspace>"]
    assert dgrad == cuda_block_bytes(154056243)
    assert wgrad == pytest.approx(155530800, abs=4 * 2**20)     # split-K sums: booked, not derived


def test_cublas_workspace_once_per_thread_after_the_first_gemm():
    with FakeTensorMode():
        a = torch.empty(64, 32, requires_grad=True)
        w = torch.empty(32, 16, requires_grad=True)

        def run():
            y = (a @ w) @ w.t()          # two GEMMs in the main thread: one workspace
            y.sum().backward()           # GEMMs in autograd's thread: its own workspace
        events = _trace(run, workspace=2**20)
    ops = [op for s, _, op in events if s > 0]
    assert ops.count("<cublas workspace: main thread>") == 1
    assert ops.count("<cublas workspace: autograd thread>") == 1
    first = ops.index("mm.default")
    assert ops[first + 1] == "<cublas workspace: main thread>"
    assert not any(s < 0 and op.startswith("<cublas") for s, _, op in events)    # kept for the process


def test_irfft_clones_its_input_and_col2im_keeps_an_input_sized_block():
    """The log's iSTFT (small): +11304960 (irfft out), +11327040 (clone), +11327040 (reshape copy),
    both freed; the fold's output keeps the 11304960 B block of its non-contiguous input's size."""
    with FakeTensorMode():
        spec = torch.empty(8, 513, 345, dtype=torch.complex64)

        def run():
            frames = torch.fft.irfft(spec, n=1024, dim=1) * torch.empty(1024)[:, None]
            return F.fold(frames, output_size=(1, 1024 + 256 * 344), kernel_size=(1, 1024), stride=(1, 256))
        events = _trace(run)
    big = [(s, n) for s, n, _ in events if n > 10**6]
    assert big[:5] == [(1, 11304960), (1, 11327488), (1, 11327488), (-1, 11327488), (-1, 11327488)]
    fold = [(s, n, op) for s, n, op in events if op in ("col2im.default", "<contiguous input>")]
    assert fold[:3] == [(1, 11304960, "col2im.default"), (1, 11304960, "<contiguous input>"),
                        (-1, 11304960, "<contiguous input>")]


def test_gradients_of_one_input_are_summed_in_place():
    """autograd's InputBuffer adds a second gradient into the first's block (real tensors); fake
    tensors (subclasses) make it allocate: the op model books the sum in the first's block."""
    def run():
        h = x * 3
        ((h * 2).sum() + (h * 5).sum()).backward()
    with FakeTensorMode():
        x = torch.empty(1000, 1000, requires_grad=True)
        plain = StorageTracker(cuda_block_bytes)
        with plain:
            run()
        plain.stop()
        x.grad = None
        modelled = _trace(run)
    adds = [a for k, a in plain.timeline.allocations.items() if a.op == "add.Tensor" and a.phase == "backward"]
    assert len(adds) == 1                                             # the out-of-place sum, fake-tensor style
    assert not [1 for s, n, op in modelled if s > 0 and op == "add.Tensor" and n == adds[0].nbytes]


def test_flash_backward_allocates_as_recorded():
    """The time-path attention of `small` (bf16, 513 x 4 heads x 345, head dim 12 padded to 16) in the
    log's backward: slice_backward's padded gradient, contiguous copies of dout and out, dq/dk/dv,
    softmax_d [B, H, 384] and dq_accum [B, 384, H, 32] fp32, in this order."""
    with FakeTensorMode():
        q, k, v = (torch.empty(513, 4, 345, 12, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.empty(513, 345, 4, 12, dtype=torch.bfloat16).transpose(1, 2)   # as the reshape gives it
        events = _backward_events(lambda: fused_attention(q, k, v, "flash", 0.1).backward(grad))
    big = [n for s, n, _ in events if s > 0 and n > 10**6]
    assert big[:8] == [cuda_block_bytes(n) for n in [22654080] * 6 + [3151872, 100859904]]


H200_EVENTS = Path(__file__).resolve().parent / "data" / "gpu"


@pytest.mark.parametrize("log,B,H,L", [("h200-2026-11-27/events/large_bf16_ckpt_1s", 2049, 12, 44),
                                       ("h200-2026-11-27/events/xlarge_bf16_ckpt_0_5s", 23, 16, 2049),
                                       ("h200-2026-11-26/events/memory_optimized_b2_ckpt", 2050, 8, 431)])
def test_auto_attention_with_an_unpadded_head_dim_books_the_recorded_workspace(log, B, H, L):
    """`auto` with bf16 and head dim 16 (no padding): the H200 ran cuDNN attention, whose backward
    asked the allocator for one B x H x L x 17 fp32 workspace (+256 B) per attention call, and never
    for FA2's dq_accum. The emulated SDPA books that workspace after dq, dk, dv, and only under
    `auto`: an explicit flash keeps FA2's buffers."""
    from tiersep.memory.trace.allocator import load_event_log

    events = load_event_log(H200_EVENTS / f"{log}.events.json.gz").events
    asked = collections.Counter(size for action, _, size in events if action == "alloc")

    def kernel_allocations(backend):
        with FakeTensorMode():
            q, k, v = (torch.empty(B, H, L, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.empty(B, H, L, 16, dtype=torch.bfloat16)

            def step():
                with CudaEmulation(backend):
                    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
                out.backward(grad)
            # what the backward kernel allocates (q, k, v are first seen by the tracker there too)
            return [n for s, n, op in _backward_events(step) if s > 0 and op in ("empty_like.default", "new_empty.default")]

    workspace = B * H * L * 17 * 4 + 256
    dq_accum = B * -(-L // 128) * 128 * H * 32 * 4
    assert kernel_allocations("auto") == [cuda_block_bytes(B * H * L * 16 * 2)] * 3 + [cuda_block_bytes(workspace)]
    assert asked[workspace] >= 2 and asked[workspace] % 2 == 0    # each call of both logged steps
    assert asked[dq_accum] == 0
    assert cuda_block_bytes(dq_accum) in kernel_allocations("flash")


@pytest.mark.parametrize("B,L,recorded", [(518, 1025, 577673600), (2050, 259, 672400000)])
def test_efficient_backward_workspace_is_the_recorded_one(B, L, recorded):
    """ultra_safe fp32 (4 heads, head dim 24): the cutlass backward's workspace in the log."""
    from tiersep.memory.trace.attention import efficient_backward_workspace

    assert efficient_backward_workspace(B, 4, L, 24, torch.float32) == recorded


@pytest.mark.parametrize("fields", [{"train__grad_accum": 3}, {"train__grad_accum": 2, "model__checkpointing": True,
                                                                 "train__precision": "fp32"}])
def test_derived_micro_batches_match_traced_ones(fields, monkeypatch):
    """Micro-batches after the first are derived from it (gradients summed in place); tracing the
    second and repeating it gives the same allocator peaks."""
    import tiersep.memory.trace.step as trace

    preset = small_preset(model__dropout=0.1, **fields)
    results = []
    for traced in (1, 2):
        monkeypatch.setattr(trace, "TRACED_MICRO_BATCHES", traced)
        r = trace.trace_step(preset, "cuda")
        results.append((r.allocated_peak, r.reserved_peak, r.micro_batches_traced))
    (alloc1, reserved1, n1), (alloc2, reserved2, n2) = results
    assert (n1, n2) == (1, 2)
    assert alloc1 == pytest.approx(alloc2, rel=1e-3) and reserved1 == pytest.approx(reserved2, rel=1e-3)


@pytest.mark.parametrize("expandable", [False, True], ids=["native", "expandable"])
def test_steady_micro_batches_are_skipped_with_the_full_replays_figures(expandable):
    """Gradient accumulation's copies repeat each other (Timeline.repeats: copy i is copy 0 with its
    keys moved on); once one leaves the allocator model as it found it, the rest are skipped, and
    every figure is the full replay's."""
    import dataclasses

    import tiersep.memory.trace.step as trace
    from tiersep.memory.trace import allocator

    preset = small_preset(model__dropout=0.1, train__batch_size=1, train__grad_accum=8)
    rec = trace.record_step(preset, "cuda")
    timeline, _ = trace.repeat_steps(rec, trace.STEPS)
    assert [count for _, _, count, _, _ in timeline.repeats] == [6] * trace.STEPS   # 7 copies, the first frees the traced one's
    for start, length, count, shift, base in timeline.repeats:
        first = timeline.events[start:start + length]
        for i in range(1, count):
            assert timeline.events[start + i * length:start + (i + 1) * length] == \
                [(k + i * shift if k >= base else k, s) for k, s in first]
    skipped = allocator.replay(timeline, exclude=rec.host, expandable_segments=expandable)
    full = allocator.replay(timeline, exclude=rec.host, expandable_segments=expandable, skip_steady=False)
    assert full.skipped_events == 0 and skipped.skipped_events >= 3 * trace.STEPS * timeline.repeats[0][1]
    assert dataclasses.replace(skipped, skipped_events=0) == full


def test_softmax_backward_holds_grad_times_output_while_it_runs():
    """softmax_backward_cuda_out (cuda/SoftMax.cu) computes `grad * output` into a temporary of the
    gradient's size after allocating its result, and frees it on return: on the math SDPA path, the
    fp32 scores' size (`small bf16 math`: 1.45 GB in the freq path, the step's allocated peak)."""
    with FakeTensorMode():
        scores = torch.empty(16, 4, 513, 513, requires_grad=True)
        grad = torch.empty(16, 4, 513, 513)
        events = _backward_events(lambda: torch._safe_softmax(scores, -1).backward(grad))
    n = cuda_block_bytes(scores.numel() * 4)
    assert [(s, size, op) for s, size, op in events if size == n][:3] == [
        (1, n, "_softmax_backward_data.default"), (1, n, "<softmax backward grad * output>"),
        (-1, n, "<softmax backward grad * output>")]


@pytest.mark.parametrize("transposed", [False, True])
def test_safe_softmax_books_what_the_allocator_serves_its_composite(transposed):
    """at::_safe_softmax is CompositeExplicitAutograd on every device in torch 2.11, so the CPU
    allocator's own events of a real call (torch.profiler, profile_memory) are an independent
    reference for what its CUDA plan books: one full-size output, filled in place; the plan of an
    older composite (a second full-size tensor from where()) read 14-17% under on checkpointed math
    attention rows of the H200 (tests/data/gpu/h200-2026-11-27)."""
    from memory_reference import allocator_changes, allocator_profile

    x = torch.randn(8, 256, 128)
    x = x.transpose(0, 1) if transposed else x
    with allocator_profile() as prof:
        y = torch._safe_softmax(x, -1)
    served = [n for _, n in allocator_changes(prof) if n]
    sizes, booked = {}, []
    for step in CudaKernelMemory(0)._safe_softmax(torch.ops.aten._safe_softmax.default, (x, -1), {}, [y]):
        if step[0] == "out":
            booked.append(y.untyped_storage().nbytes())
        elif step[0] == "alloc":
            sizes[step[1]] = step[2]
            booked.append(step[2])
        else:
            booked.append(-sizes[step[1]])
    assert booked == served


def test_bmm_copies_only_the_operands_cublas_cannot_take():
    """baddbmm_out_cuda_impl (cuda/Blas.cpp): a batch matrix with a unit stride and a wide enough
    leading dimension goes to cuBLAS as it is (a transpose is a flag); one with neither is cloned
    contiguous first, inside the op, and freed after the GEMM."""
    with FakeTensorMode():
        a = torch.empty(8, 64, 32)
        b = torch.empty(8, 16, 32).transpose(1, 2)          # [8, 32, 16], a transposed view: no copy
        strided = torch.empty(8, 64, 64)[:, ::2, ::2]       # [8, 32, 32], no unit stride: a copy
        plain = _trace(lambda: torch.bmm(a, b), workspace=0)
        copied = _trace(lambda: torch.bmm(a, strided), workspace=0)
    assert [op for s, _, op in plain] == ["bmm.default"]
    assert [(s, n, op) for s, n, op in copied] == [
        (1, cuda_block_bytes(8 * 64 * 32 * 4), "bmm.default"),
        (1, cuda_block_bytes(8 * 32 * 32 * 4), "<bmm operand copy 1>"),
        (-1, cuda_block_bytes(8 * 32 * 32 * 4), "<bmm operand copy 1>")]


def test_mm_copies_a_matrix_with_no_unit_stride():
    with FakeTensorMode():
        a = torch.empty(64, 128)[:, ::2]                   # [64, 64], strides (128, 2): a copy
        w = torch.empty(64, 32)
        events = _trace(lambda: a @ w, workspace=0)
    copies = [(s, n) for s, n, op in events if op.startswith("<mm operand copy")]
    assert copies == [(1, cuda_block_bytes(64 * 64 * 4)), (-1, cuda_block_bytes(64 * 64 * 4))]
