"""What one whole-step prefill runs besides matmuls and compiled kernels: nothing stray may come back.

On the GPU the step is one CUDA graph of the split graph's Inductor pieces and the attention breaks
between them; every aten op the breaks (or the pieces' wrappers) issue eagerly becomes a kernel or a
copy in that graph. On the CPU the same step runs (llama-tiny, the Triton backend under the
interpreter, whole-step prefill in host-replay mode), and a dispatch mode around the compiled step
sees every aten op that reaches the dispatcher: the pieces' extern matmuls, views, custom ops and
any eager op of a break. Inductor's own kernels do not go through the dispatcher, and the aten ops
Triton's interpreter runs inside a kernel launch are left out (the launch itself is recorded).

Before this test existed, each layer's attention break zeroed the padding rows with arange, select,
ge, two unsqueezes and masked_fill_ (three kernels per layer on the GPU) and launched
``_kv_write_kernel`` before the dense extend kernel.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tscompile
import tscompile.backend
from tscompile.runtime.graph_runner import HostGraphs

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear"}
# ops that only make a view or read metadata: no kernel, no copy
VIEWS = {"view", "_unsafe_view", "as_strided", "reshape", "select", "slice", "unsqueeze", "squeeze", "t",
         "permute", "transpose", "expand", "alias", "split", "split_with_sizes", "chunk", "detach", "unbind",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
PROMPT_LEN = 20  # pads to the 32-token bucket: 12 padding rows


class StepOps(TorchDispatchMode):
    """Records ``(kind, name)``: ("aten", op) for dispatcher ops, ("triton", kernel) per launch."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log
        self.in_kernel = 0
        self.recording = False  # launches count only while the step is recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel:
            self.log.append(("aten", str(func.overloadpacket).removeprefix("aten.")))
        return func(*args, **(kwargs or {}))


def _record_triton_launches(mode: StepOps, monkeypatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        if mode.recording and not mode.in_kernel:
            mode.log.append(("triton", self.fn.__name__))
        mode.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.in_kernel -= 1

    monkeypatch.setattr(InterpretedFunction, "run", launch)


def whole_step_prefill_ops(dtype: torch.dtype = torch.float32) -> collections.Counter:
    """The ops of one warm whole-step prefill of a PROMPT_LEN-token prompt on llama-tiny (2 layers)."""
    log: list = []
    compile_graph = tscompile.backend.compile_graph
    mode = StepOps(log)

    def compile_graph_recorded(*args, **kwargs):
        fn = compile_graph(*args, **kwargs)

        def run(*inputs):  # entered inside Dynamo's compiled frame: Dynamo never sees the mode
            if not mode.recording:
                return fn(*inputs)
            with mode:
                return fn(*inputs)
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tscompile.backend, "compile_graph", compile_graph_recorded)
        _record_triton_launches(mode, mp)
        llm = tscompile.LLM("llama-tiny", device="cpu", dtype=dtype, attention_backend="triton", max_model_len=64,
                            max_num_seqs=2, page_size=16, max_num_batched_tokens=32,
                            compile_options={"token_ladder": (16, 32), "prefill_graph_max_tokens": 32,
                                             "decode_ladder": (1, 2)},
                            enable_prefix_caching=False)  # the rerun prompt must run whole, not as a hit
        llm.runner.use_graphs(HostGraphs(), decode=False, prefill="whole")
        prompt = [i % 500 + 1 for i in range(PROMPT_LEN)]
        one = tscompile.SamplingParams(max_new_tokens=1)
        llm.generate([prompt], one)  # compiles
        mode.recording = True
        llm.generate([prompt], one)
        mode.recording = False
    return collections.Counter(log)


def device_work(ops: collections.Counter) -> collections.Counter:
    """The recorded ops that run device work and are neither a matmul nor a Triton kernel."""
    return collections.Counter({(kind, name): n for (kind, name), n in ops.items()
                                if kind == "aten" and name not in MATMULS and name not in VIEWS})


@pytest.fixture(scope="module")
def step_ops():
    return whole_step_prefill_ops()


def test_the_only_eager_device_op_is_the_sampler(step_ops):
    """No zeroing, cast, copy, fill or cat around the attention breaks: of the non-matmul aten ops,
    only the sampling op (its kernels are the step's last) runs."""
    assert device_work(step_ops) == collections.Counter({("aten", "tscompile.sample"): 1}), step_ops


def test_one_attention_kernel_per_layer(step_ops):
    """head_dim 64 runs the dense extend kernel, which writes the new K/V itself: one launch per
    layer, no ``_kv_write_kernel``."""
    layers = tscompile.models.llama.PRESETS["llama-tiny"].n_layers
    triton = {name: n for (kind, name), n in step_ops.items() if kind == "triton"}
    assert triton == {"_extend_dense_kernel": layers}, triton


def test_the_matmuls_are_all_there(step_ops):
    """The recording saw the pieces: every layer's four projections and the LM head."""
    layers = tscompile.models.llama.PRESETS["llama-tiny"].n_layers
    matmuls = sum(n for (kind, name), n in step_ops.items() if kind == "aten" and name in MATMULS)
    assert matmuls == 4 * layers + 1, step_ops


# -- the same step on the GPU: the kernels of one whole-step graph replay ------------------------------


@pytest.mark.gpu
def test_gpu_whole_step_prefill_graph_has_no_stray_copies():
    """llama-tiny in bfloat16 over Triton, whole-step prefill graphs: one replayed prefill step holds
    no device-to-device copy, no aten elementwise kernel and no ``_kv_write_kernel``."""
    from torch.profiler import ProfilerActivity, profile

    llm = tscompile.LLM("llama-tiny", device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                        max_model_len=128, max_num_seqs=2, page_size=16, max_num_batched_tokens=64,
                        compile_options={"token_ladder": (16, 32, 64), "prefill_graph_max_tokens": 64,
                                         "decode_ladder": (1, 2), "prefill_graph_mode": "whole"})
    assert llm.runner.prefill.whole is not None
    prompt = [i % 500 + 1 for i in range(PROMPT_LEN)]
    one = tscompile.SamplingParams(max_new_tokens=1)
    for _ in range(2):
        llm.generate([prompt], one)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], one)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    stray = [n for n in names if "Memcpy DtoD" in n or "at::native::elementwise_kernel" in n
             or "arange" in n or "_kv_write_kernel" in n]
    assert not stray, collections.Counter(stray)
    assert names.count("_extend_dense_kernel") == llm.model.config.n_layers
