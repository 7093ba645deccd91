"""torch.compile of the TF-Locoformer: whole-graph capture for every shipped preset, compiled against
eager (inductor's CPU backend) with and without checkpointing, and the compile helper's fallback
and caches.

Inductor compiles C++ kernels with the system compiler: on a 2-core machine about a minute per
model, so those cases are marked slow. Every preset is captured with aot_eager on fake tensors at
its real shapes (Dynamo + AOTAutograd, no arithmetic), one layer deep: the layers are identical.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from tiersep.config import load_preset
from tiersep.model import SeparationLoss, TFLocoformer, build_loss, build_model
from tiersep.model.compile import compile_model
from tiersep.model.loss import default_resolutions

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "config" / "presets").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _one_thread_fresh_dynamo(single_thread):
    """One torch thread (see conftest.one_torch_thread); no compiled code shared between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model(**kwargs) -> TFLocoformer:
    args = dict(n_sources=4, channels=2, n_fft=64, hop=32, n_layers=1, emb_dim=8, attention_dim=8,
                n_heads=2, ffn_hidden=16, norm_groups=4, dropout=0.0)
    args.update(kwargs)
    torch.manual_seed(0)
    return TFLocoformer(**args)


def batch(length: int = 1024):
    torch.manual_seed(1)
    return torch.randn(2, 2, length), torch.randn(2, 4, 2, length)


def loss_and_grads(model, call, mixture, stems, autocast: bool = False):
    """Loss of one training step through `call` (the model, compiled or not) and the gradients."""
    loss_fn = SeparationLoss(1.0, 1.0, default_resolutions(64))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        estimates = call(mixture)
    loss = loss_fn(estimates.float(), stems)
    loss.backward()
    return estimates.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# whole-graph capture


@pytest.mark.parametrize("settings, autocast", [
    ({}, False),
    ({"checkpointing": True}, False),
    ({"checkpointing": True, "dropout": 0.1}, True),
    ({"attention_chunk": 7, "attention_backend": "math"}, False),
])
def test_dynamo_finds_no_graph_break(settings, autocast):
    model = tiny_model(**settings).train()
    mixture, _ = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        report = torch._dynamo.explain(model)(mixture)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    assert report.graph_count == 1 and report.op_count > 20  # with checkpointing a block counts as one op


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_compiles_as_one_graph(name):
    """fullgraph=True raises on any graph break; forward and backward at the preset's real shapes,
    precision and checkpointing (fake tensors: nothing is computed)."""
    preset = load_preset(name)
    preset["model"]["n_layers"] = 1
    samples, batch_size = preset["audio"]["segment_samples"], preset["train"]["batch_size"]
    bf16 = preset["train"]["precision"] == "bf16"
    with FakeTensorMode():
        model = build_model(preset).train()
        mixture, stems = torch.randn(batch_size, 2, samples), torch.randn(batch_size, 4, 2, samples)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            estimates = compiled(mixture)
        build_loss(preset)(estimates.float(), stems).backward()
    assert estimates.shape == (batch_size, 4, 2, samples) and estimates.dtype == torch.float32
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.slow
def test_new_segment_length_recompiles_with_symbolic_shapes():
    """A second length makes Dynamo recompile once with a symbolic length, which serves the third
    length too: two graphs in all (counted), each whole (fullgraph), the same values as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = tiny_model().eval()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        for length in (1024, 1000, 777):
            mixture, _ = batch(length)
            torch.testing.assert_close(compiled(mixture), model(mixture), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 2
    symbolic = [node.meta["example_value"].shape for node in counter.graphs[1].graph.nodes
                if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor)]
    assert any(isinstance(size, torch.SymInt) for shape in symbolic for size in shape)


# ----------------------------------------------------------------------------------------------
# inductor against eager


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_inductor_matches_eager_forward_and_backward(checkpointing):
    model = tiny_model(checkpointing=checkpointing).train()
    mixture, stems = batch()
    eager = loss_and_grads(model, model, mixture, stems)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    out, loss, grads = loss_and_grads(model, compiled, mixture, stems)
    out_e, loss_e, grads_e = eager
    assert not torch.equal(out, out_e) or not torch.equal(loss, loss_e)  # inductor's own kernels ran
    torch.testing.assert_close(out, out_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=0)
    for name, grad in grads_e.items():
        scale = grad.abs().max()
        assert (grads[name] - grad).abs().max() <= 1e-4 * scale + 1e-7, name


# ----------------------------------------------------------------------------------------------
# the compile helper


def failing_backend(gm, example_inputs):
    raise RuntimeError("no code generator for this device")


def failing_backward_compiler(gm, example_inputs):
    raise RuntimeError("backward kernels unsupported here")


def test_helper_falls_back_when_the_backend_fails():
    model = tiny_model().train()
    mixture, stems = batch()
    expected = loss_and_grads(model, model, mixture, stems)
    warnings = []
    call, info = compile_model(model, "default", backend=failing_backend, warn=warnings.append)
    assert info["compiled"] is True and info["reason"] is None  # lazy: nothing compiled yet
    out, loss, grads = loss_and_grads(model, call, mixture, stems)
    assert info["compiled"] is False and "no code generator for this device" in info["reason"]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "no code generator" in warnings[0]
    assert torch.equal(out, expected[0]) and torch.equal(loss, expected[1])
    assert all(torch.equal(grads[n], g) for n, g in expected[2].items())
    loss_and_grads(model, call, mixture, stems)  # later calls run eagerly, without a new warning
    assert len(warnings) == 1


def test_helper_catches_a_failure_of_the_lazily_compiled_backward():
    """The forward compiles; the backward compiler fails at the first backward. The helper runs
    that backward inside the first call, so the step falls back instead of dying."""
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=failing_backward_compiler)
    backend.__name__ = "aot_failing_backward"
    model = tiny_model().train()
    mixture, stems = batch()
    warnings = []
    call, info = compile_model(model, None, backend=backend, warn=warnings.append)
    _, loss, grads = loss_and_grads(model, call, mixture, stems)
    assert info["compiled"] is False and "backward kernels unsupported" in info["reason"]
    assert info["mode"] == "default" and info["backend"] == "aot_failing_backward"
    assert torch.isfinite(loss) and all(g.abs().sum() > 0 for g in grads.values())
    assert len(warnings) == 1


def test_helper_keeps_real_errors():
    """A bad input is the caller's error (eager's message, compile stays on); an out-of-memory error
    propagates without an eager retry. The OOM is raised by the compiled code itself: a CPU
    cannot be made to run out of memory in a test."""
    model = tiny_model().train()
    warnings = []
    call, info = compile_model(model, "default", backend="aot_eager", warn=warnings.append)
    with pytest.raises(ValueError, match="2 channels"):
        call(torch.randn(1, 1, 1024))
    assert info["compiled"] is True and warnings == []

    def out_of_memory_backend(gm, example_inputs):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    eager_calls = []
    model.register_forward_hook(lambda *_: eager_calls.append(1))
    torch._dynamo.reset()
    call, info = compile_model(model, "default", backend=out_of_memory_backend, warn=warnings.append)
    with pytest.raises(torch.OutOfMemoryError):
        call(batch()[0])
    assert eager_calls == [] and info["compiled"] is True and warnings == []


def test_helper_rejects_an_unknown_mode_and_survives_an_unknown_backend():
    with pytest.raises(ValueError, match="train.compile_mode: 'fastest'"):
        compile_model(tiny_model(), "fastest")
    warnings = []
    model = tiny_model()
    call, info = compile_model(model, "default", backend="no_such_backend", warn=warnings.append)
    assert call is model and info["compiled"] is False and "no_such_backend" in info["reason"]
    assert len(warnings) == 1


def test_helper_state_dict_is_the_models():
    model = tiny_model()
    call, _ = compile_model(model, "default", backend="aot_eager", warn=print)
    assert list(call.state_dict()) == list(model.state_dict())
    assert sum(p.numel() for p in call.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # a fresh inductor cache: about a minute of C++ compiling on 2 cores
def test_helper_puts_inductor_caches_in_cache_dir_and_reuses_them(tmp_path, monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    counters = torch._dynamo.utils.counters
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
    x = torch.randn(4, 16)
    call, info = compile_model(layer, "default", tmp_path / "cache", warn=print)
    counters.clear()
    torch.testing.assert_close(call(x), layer(x))
    assert info["compiled"] is True and info["cache_dir"] == str(tmp_path / "cache")
    files = [p for p in (tmp_path / "cache" / "inductor").rglob("*") if p.is_file()]
    assert files, "inductor wrote nothing under cache_dir"
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1

    torch._dynamo.reset()  # as a later trial in a new process: compiled code comes from the disk
    counters.clear()
    call, _ = compile_model(layer, "default", tmp_path / "cache", warn=print)
    torch.testing.assert_close(call(x), layer(x))
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
