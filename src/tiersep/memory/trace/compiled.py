"""The graphs a compiled training step runs, run on fake tensors under the trace's StorageTracker.

`torch.compile(model, backend=...)` works on FakeTensorMode models and inputs: Dynamo fakeifies them
again and calls the backend with FX graphs. The backend here is AOTAutograd with inductor's own
decompositions and its min-cut partitioner (`compiler="inductor"`), so the forward graph saves for
backward what inductor's forward saves, and the backward recomputes what inductor's recomputes.
The graphs are then run op by op (an FX Interpreter with the boxed calling convention, which drops
each input and intermediate after its last use as inductor's generated code does), so the tracker
counts them like any eager step.

What inductor adds on top of the partition is fusion: a pointwise op feeding only other fusible ops
is computed inside its consumer's kernel and never gets a buffer. `materialised` applies inductor's
rules (torch/_inductor/graph.py, ir.py) to decide which nodes get a buffer, and the runner hides
the others from the tracker:
- a buffer is made for every output of a non-fusible op (matmuls, convolutions, FFTs, reductions,
  cat, scatters), for every graph output (returns, saved activations), and for a fusible op's
  result that a non-fusible op (other than a reduction or cat, which fuse their inputs) or the
  graph's output reads;
- a fusible result read by more than one op is realized when it reads more than 4 buffers, or
  holds more than 30 ops, or (CPU) computes exp or sigmoid; any fusible result reading more than 8
  buffers is realized.
Left out: the order inductor's scheduler gives the kernels (the trace keeps the graphs' order;
with checkpointing the real step kept far more alive, so estimate() does not use this trace for
checkpointed models), in-place buffer reuse and inductor's joint-graph pattern passes. Measured
against real inductor-compiled CPU steps: bench/results/compiled_estimate_cpu.md.

Dynamo specifics: it compiles nothing under a TorchDispatchMode, so compile_now compiles the graphs
by one step before the tracker starts, and the tracker (CompiledStepTracker) lets Dynamo run its
compiled code under it; one backend serves every trace (Dynamo guards on the backend's identity).
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from .tracker import StorageTracker

# inductor's realize thresholds (torch._inductor.config; read from there when available)
READS_ON_REUSE, OPS_ON_REUSE, MAX_READS = 4, 30, 8
HEAVY_ON_CPU = ("exp", "sigmoid")
# Not tagged pointwise, but lowered by inductor into the consumer's loop (no buffer of their own).
FUSED_OPS = frozenset("""
    clone constant_pad_nd slice_scatter select_scatter index _unsafe_index full full_like zeros
    zeros_like ones ones_like scalar_tensor iota rand rand_like randn randn_like hann_window
    where convert_element_type fill copy _to_copy expand_copy lift_fresh_copy
""".split())
# Produce a buffer but compute their inputs inside their own loop (reductions, cat).
FUSING_CONSUMERS = frozenset("""
    sum mean amax amin max min var var_mean any all prod argmax argmin cat
""".split())


def _name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def _fusible(node: fx.Node) -> bool:
    if node.op != "call_function" or _is_view(node):
        return False
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) or _name(node) in FUSED_OPS


def _readers(node: fx.Node):
    """The nodes that read `node`'s data, looking through views ('output' for the graph's)."""
    for user in node.users:
        if user.op == "output":
            yield "output"
        elif _is_view(user):
            yield from _readers(user)
        else:
            yield user


def materialised(graph: fx.Graph, device: str) -> set[fx.Node]:
    """The call_function nodes whose results inductor would give a buffer (module docstring)."""
    try:
        from torch._inductor import config
        reads_on_reuse, ops_on_reuse = config.realize_reads_threshold, config.realize_opcount_threshold
        max_reads = config.realize_acc_reads_threshold
    except (ImportError, AttributeError):
        reads_on_reuse, ops_on_reuse, max_reads = READS_ON_REUSE, OPS_ON_REUSE, MAX_READS
    real: set[fx.Node] = set()
    reads: dict[fx.Node, frozenset] = {}    # fused node -> buffers its loop reads
    ops: dict[fx.Node, tuple[int, frozenset]] = {}   # fused node -> (op count, op names)
    for node in graph.nodes:
        if node.op != "call_function" or _is_view(node):
            continue
        if not _fusible(node):
            real.add(node)
            continue
        my_reads, count, names = set(), 1, {_name(node)}
        for arg in node.all_input_nodes:
            base = _base(arg)
            if base in reads:
                my_reads |= reads[base]
                count += ops[base][0]
                names |= ops[base][1]
            else:
                my_reads.add(base)
        readers = list(_readers(node))
        reused = len(node.users) > 1 and (
            len(my_reads) > reads_on_reuse or count > ops_on_reuse
            or (device == "cpu" and any(n in names for n in HEAVY_ON_CPU)))
        if reused or len(my_reads) > max_reads or any(
                r == "output" or not (_fusible(r) or _name(r) in FUSING_CONSUMERS) for r in readers):
            real.add(node)
        else:
            reads[node] = frozenset(my_reads)
            ops[node] = (count, frozenset(names))
    return real


def _base(node: fx.Node) -> fx.Node:
    while _is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


class FusedRunner(fx.Interpreter):
    """Runs a partitioned graph op by op for the trace of `holder` (boxed_run's): the results of
    fused nodes are hidden from its tracker."""

    def __init__(self, gm: fx.GraphModule, device: str):
        super().__init__(gm)
        self.real = materialised(gm.graph, device)
        self.tracker = None

    def boxed_run(self, args_list, holder=None):
        self.tracker = holder.tracker if holder is not None else None
        if self.tracker is not None:
            holder.runs += 1
        try:
            return super().boxed_run(args_list)
        finally:
            # fx.Interpreter keeps the output node's value in env until its next run: a forward's
            # outputs are the activations saved for backward, which compiled code does not hold
            # once AOTAutograd's backward has freed them (it kept a micro-batch's saved activations
            # alive into the next micro-batch's forward: large traced at 1.3x eager, not 0.7x).
            self.env = {}
            self.tracker = None

    def run_node(self, n: fx.Node):
        tracker = self.tracker
        if tracker is None or n.op != "call_function" or n in self.real or _is_view(n):
            return super().run_node(n)
        recording, tracker.recording = tracker.recording, False
        try:
            return super().run_node(n)
        finally:
            tracker.recording = recording


class CompiledStepTracker(StorageTracker):
    """A StorageTracker under which Dynamo runs its compiled code (it runs a function eagerly under
    any other TorchDispatchMode); the FusedRunner's ops then reach the tracker one by one, higher-order
    ones too (run_and_save_rng_state: dropout in a checkpointed, recomputed region)."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator):
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))     # its outputs are counted; no op model knows it
        if self.recording:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self._see(value, func.name())
        return out

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class TraceHolder:
    """What the compiled graphs report to: the tracker of the step being traced, and the graphs."""

    def __init__(self):
        self.tracker = None
        self.graphs: dict[str, fx.GraphModule] = {}
        self.runs = 0          # graphs run while a tracker was set

    @contextlib.contextmanager
    def tracking(self, tracker):
        """Report the graphs' ops to `tracker` while the traced step runs; then check_ran."""
        self.tracker = tracker
        try:
            yield
        finally:
            self.tracker = None
        self.check_ran()

    def check_ran(self) -> None:
        """Fail unless the traced step ran the compiled forward and backward graphs (Dynamo runs
        a function eagerly, silently, when it cannot use its compiled code)."""
        if set(self.graphs) != {"forward", "backward"} or self.runs < 2:
            raise RuntimeError(f"compiled trace: the step ran {self.runs} compiled graph(s) of "
                               f"{sorted(self.graphs) or 'none'}; expected the forward and the backward")


def compile_for_trace(model: torch.nn.Module, holder: TraceHolder, device: str,
                      emulation=None) -> torch.nn.Module:
    """`model` compiled with AOTAutograd and inductor's partitioner, its graphs run by FusedRunner.
    `emulation` (the trace's CudaEmulation, a TorchFunctionMode Dynamo cannot trace): applied while
    AOTAutograd traces Dynamo's graph, so the graphs hold CUDA's casts and kernels; it is popped
    while Dynamo runs (Dynamo must find the mode stack as when it compiled)."""
    return TracedCompile(model, (holder, device, emulation))


# The trace being run, (holder, device, emulation): set by TracedCompile, read by the backend and
# the forward graphs (Dynamo reuses compiled graphs across traces of equal models and shapes).
_target: list = []
# Compiled traces one process may hold (`tiersep fit` traces many candidates). They are entries of
# `_call`'s code alone: Dynamo's limit on the trainer's own compiled model is untouched.
MAX_TRACED_GRAPHS = 256


def _call(model: torch.nn.Module, kind: str, *args):
    """The function Dynamo compiles: `kind` (device and emulation) is a guarded constant, so graphs
    traced for one device are never reused for another."""
    return model(*args)


@functools.cache
def _compiled_call():
    return torch.compile(_call, backend=_backend, fullgraph=True, dynamic=False)


def _backend(gm: fx.GraphModule, example_inputs):
    """AOTAutograd with inductor's decompositions and partitioner; each graph run by a FusedRunner.
    One backend for every trace: Dynamo guards on the backend's identity."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    _, device, emulation = _target[-1]
    served = {}      # the holder of the trace whose forward ran last: its backward reports there too

    def runner(kind):
        def compile_graph(graph_module, _inputs):
            interpreter = FusedRunner(graph_module, device)

            def run(args):
                if kind == "forward":
                    served["holder"] = _target[-1][0] if _target else None
                holder = served.get("holder")
                if holder is not None:
                    holder.graphs[kind] = graph_module
                return interpreter.boxed_run(args, holder)
            run._boxed_call = True     # AOTAutograd hands over (and we clear) the argument list
            return run
        return compile_graph

    aot = aot_autograd(
        fw_compiler=runner("forward"), bw_compiler=runner("backward"), inference_compiler=runner("forward"),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        decompositions=select_decomp_table(), keep_inference_input_mutations=True)
    with emulation if emulation is not None else contextlib.nullcontext():
        return aot(gm, example_inputs)


class TracedCompile(torch.nn.Module):
    """The compiled model of one trace: calls `_call` compiled, with the trace as `_target` and
    the emulation (the innermost TorchFunctionMode while a step is traced) popped."""

    def __init__(self, model: torch.nn.Module, target: tuple):
        super().__init__()
        self.model = model
        self.target = target

    def forward(self, *args):
        from torch._dynamo import config
        from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

        _, device, emulation = self.target
        kind = device + ("-emulated" if emulation is not None else "")
        _target.append(self.target)
        try:
            with config.patch(recompile_limit=MAX_TRACED_GRAPHS, accumulated_recompile_limit=MAX_TRACED_GRAPHS):
                if emulation is None or _get_current_function_mode() is not emulation:
                    return _compiled_call()(self.model, kind, *args)
                with _pop_mode_temporarily():
                    return _compiled_call()(self.model, kind, *args)
        finally:
            _target.pop()


def compile_now(model: torch.nn.Module, work, preset: dict, device: str, context, emulation=None) -> tuple:
    """(compiled model, its TraceHolder), its graphs compiled by one forward and backward on the
    first micro-batch, under `context(model)` (the trace's emulation), before any tracker runs:
    Dynamo does not compile under a TorchDispatchMode such as the StorageTracker."""
    from tiersep.model.step import autocast

    holder = TraceHolder()
    compiled = compile_for_trace(model, holder, device, emulation)
    mixture, stems = work.inputs[0]
    with context(compiled):
        with autocast(preset["train"]["precision"], device):
            estimates = compiled(mixture)
        work.loss_fn(estimates.float(), stems).backward()
    work.optimizer.zero_grad(set_to_none=True)
    return compiled, holder
