"""The torch.compile backend on the CPU: entry point, options, split structure, compiled equals
eager, recompilation counters, narrowing, split_sdpa on a stock transformers model, debug dump."""

import os
import subprocess
import sys

import pytest
import torch

from tscompile import SamplingParams
from tscompile.forward_context import ForwardMode
from tscompile.counters import counters
from tscompile.passes.split import split_graph

from helpers import PROMPTS, ids, record_inductor_patches, record_modes, small_llm

def make_llm(model="llama-tiny", **kw):
    kw.setdefault("dtype", torch.float32)
    return small_llm(model, **kw)


def test_entry_point_works_in_a_fresh_process():
    code = (
        "import sys, torch\n"
        "assert 'tscompile' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())\n"
        "x = torch.randn(3, 8)\n"
        "out = torch.compile(m, backend='tscompile', options={'piece_compiler': 'eager'})(x)\n"
        "assert torch.allclose(out, m(x))\n"
        "print('ok', 'tscompile' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok True"  # the entry point imported tscompile, the script did not


def test_unknown_option_is_refused_with_the_known_ones():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match=r"tscompile: unknown option\(s\) \['nope'\]; known options: \['piece_compiler'"):
        torch.compile(m, backend="tscompile", options={"nope": 1})(torch.randn(2, 4))


def test_inductor_options_are_validated_and_reach_every_inductor_compile(monkeypatch):
    from tscompile.config import TscompileConfig
    from tscompile.runtime.model_runner import decode_static_inductor_options

    with pytest.raises(ValueError, match=r"tscompile: inductor_options names unknown .*\['no_such_knob'\]"):
        TscompileConfig.from_options({"inductor_options": {"no_such_knob": 1}})
    with pytest.raises(ValueError, match="tscompile: inductor_options must be a dict"):
        TscompileConfig.from_options({"inductor_options": 3})
    seen = record_inductor_patches(monkeypatch)
    torch.compiler.reset()
    m = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    out = torch.compile(m, backend="tscompile", options={"inductor_options": {"epilogue_fusion": False}})(x)
    torch.testing.assert_close(out, m(x))
    assert seen and seen[0]["epilogue_fusion"] is False and seen[0]["triton.cudagraphs"] is False
    # static-only patches reach a static graph and not a dynamic one
    seen.clear()
    opts = {"static_inductor_options": {"epilogue_fusion": False}}
    fn = torch.compile(lambda a: a * 2 + 1, backend="tscompile", options=opts, dynamic=True)
    fn(torch.randn(5))
    assert seen and "epilogue_fusion" not in seen[-1]
    seen.clear()
    torch.compile(lambda a: a * 3 - 1, backend="tscompile", options=opts, dynamic=False)(torch.randn(5))
    assert seen and seen[-1]["epilogue_fusion"] is False
    # the engine's bs=1 decode graph is tuned only when the user asks (the tuning doubles start-up)
    assert decode_static_inductor_options(TscompileConfig(), torch.device("cuda")) == {}
    cfg = TscompileConfig.from_options({"static_inductor_options": {"coordinate_descent_tuning": True}})
    assert decode_static_inductor_options(cfg, torch.device("cuda")) == {"coordinate_descent_tuning": True}


def test_module_without_tscompile_ops_compiles_whole_like_inductor():
    torch.compiler.reset()
    assert counters["graphs"] == 0  # reset() reaches tscompile's own state
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 4))
    x = torch.randn(5, 16)
    out = torch.compile(m, backend="tscompile")(x)
    torch.testing.assert_close(out, m(x))
    assert counters["graphs"] == 1 and counters["pieces_compiled"] == 1 and counters["breaks"] == 0


def test_tensorrt_piece_compiler_refuses_clearly_when_missing():
    try:
        import torch_tensorrt  # noqa: F401
        pytest.skip("torch-tensorrt is installed")
    except ImportError:
        pass
    m = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="tscompile: piece_compiler='tensorrt' needs torch-tensorrt"):
        torch.compile(m, backend="tscompile", options={"piece_compiler": "tensorrt"})(torch.randn(2, 4))


def _traced_prefill_graph(model_name):
    """The Dynamo graph of one prefill step of the engine's model (not compiled)."""
    llm = make_llm(model_name, enforce_eager=True)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from tscompile.backend import tracing_config
    step = torch.compile(llm.runner.prefill.forward, backend=capture, dynamic=True)
    llm.runner.prefill.compiled = lambda *a: _call(step, tracing_config, *a)
    ids(llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1)))
    assert len(graphs) == 1
    return graphs[0]


def _call(fn, ctx, *args):
    with ctx():
        return fn(*args)


def test_split_structure_of_the_llama_model():
    gm = _traced_prefill_graph("llama-tiny")
    split, plan = split_graph(gm)
    kinds = [p.kind for p in plan.pieces]
    assert kinds == ["compiled", "break", "compiled", "break", "compiled"]  # 2 layers, 2 breaks
    assert all(p.ops == ("tscompile::attention",) for p in plan.of_kind("break"))
    assert {p.stage for p in plan.pieces} == {"encoder"}
    for piece in plan.of_kind("break"):  # a break piece holds the op and nothing that computes
        nodes = [n for n in getattr(split, piece.name).graph.nodes if n.op == "call_function"]
        assert [str(n.target) for n in nodes] == ["tscompile.attention"]
    # once compiled, the break pieces call the op's body directly (no dispatcher) and stay eager
    from tscompile.custom_ops.attention import run_attention
    from tscompile.piece_compiler import _call_breaks_directly
    _call_breaks_directly(split, plan)
    for piece in plan.of_kind("break"):
        targets = [n.target for n in getattr(split, piece.name).graph.nodes if n.op == "call_function"]
        assert targets == [run_attention]


def test_split_structure_of_the_narrowing_model():
    gm = _traced_prefill_graph("narrow-tiny")
    split, plan = split_graph(gm)
    inputs = [(piece, node) for piece in plan.pieces for node in getattr(split, piece.name).graph.nodes
              if node.op == "placeholder"]
    assert all(isinstance(n.meta.get("example_value"), (torch.Tensor, torch.SymInt)) for _, n in inputs), \
        [(p.name, n.name, n.meta.get("example_value")) for p, n in inputs]  # no Size, no SymBool crosses
    kinds = [(p.kind, p.stage) for p in plan.pieces]
    enc, dec = ("compiled", "encoder"), ("compiled", "decoder")
    assert kinds == [enc, ("break", "encoder"), enc, ("break", "encoder"), enc, ("narrow", "encoder"),
                     dec, ("break", "decoder"), dec, ("break", "decoder"), dec]
    assert plan.of_kind("narrow")[0].ops == ("tscompile::narrow_rows",)
    _, no_narrow = split_graph(gm, split_narrowing=False)
    assert not no_narrow.of_kind("narrow") and no_narrow.num_breaks == 4


def _record_logits(llm):
    """Snapshot each step's logits outside the compiled region: traced, the append would put the
    list's length into the step's guards, and every step would compile the step again."""
    seen = []
    original = llm.runner.sampling.sample

    @torch._dynamo.disable
    def record(logits):
        seen.append(logits.detach().clone())

    def sample(logits, *args):
        record(logits)
        return original(logits, *args)

    llm.runner.sampling.sample = sample
    return seen


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
def test_compiled_equals_eager_in_decode_prefill_mixed_and_chunked_steps(model):
    params = SamplingParams(max_new_tokens=5)
    eager = make_llm(model, enforce_eager=True, max_num_batched_tokens=6)
    compiled = make_llm(model, max_num_batched_tokens=6)
    modes = record_modes(compiled)
    eager_logits, compiled_logits = _record_logits(eager), _record_logits(compiled)
    assert ids(compiled.generate(PROMPTS, params)) == ids(eager.generate(PROMPTS, params))
    assert {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE} <= set(modes)
    assert len(eager_logits) == len(compiled_logits)
    for a, b in zip(eager_logits, compiled_logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_no_recompilation_across_steady_decode_and_prefill_steps():
    torch._dynamo.utils.counters["graph_break"].clear()
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=4)
    # warm every variant a batch can take: Dynamo specializes a size of 1 and a batch that fills the
    # max_num_seqs-row buffers, so 1 request, 2 requests and a full batch, in extend, mixed and decode
    ids(llm.generate(PROMPTS, SamplingParams(max_new_tokens=4)))
    ids(llm.generate([[4] * 3], SamplingParams(max_new_tokens=3)))
    ids(llm.generate([[5] * 7, [6] * 2], SamplingParams(max_new_tokens=3)))
    ids(llm.generate([[i + 1] * 2 for i in range(4)], SamplingParams(max_new_tokens=3)))  # decode with 4 rows
    graphs, frames = counters["graphs"], dict(torch._dynamo.utils.counters["frames"])
    more = [[9] * 13, [8] * 2, [7] * 30, [6] * 5]
    ids(llm.generate(more, SamplingParams(max_new_tokens=9)))
    assert counters["graphs"] == graphs
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    # every engine step (decode whole, prefill split by the backend) traced as one Dynamo graph
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_hitting_the_recompile_limit_is_an_error_not_a_silent_eager_fallback(monkeypatch):
    """A step that keeps recompiling must fail loudly: Dynamo would otherwise run it eagerly from
    then on, without graphs, and nothing would say so."""
    import tscompile.backend as backend
    from tscompile.config import TscompileConfig

    monkeypatch.setattr(backend, "RECOMPILE_LIMIT", 2)

    def scaled(x, tag: str):
        return x * len(tag)  # a str is a constant: every new tag recompiles (ints would stay dynamic)

    step = backend.compile_step(scaled, TscompileConfig(piece_compiler="eager"))
    x = torch.randn(3)
    for tag in ("a", "bb"):
        assert torch.equal(step(x, tag), x * len(tag))
    with pytest.raises(Exception, match="(?i)recompile"):
        step(x, "ccc")


class _Narrowed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(8, 8)
        self.dec = torch.nn.Linear(8, 3)

    def forward(self, x, pos, indptr, completes):
        h = torch.relu(self.enc(x))
        rows, kept = torch.ops.tscompile.narrow_rows(h, pos, indptr, completes, 2)
        return self.dec(rows) * kept[:, None]


def test_narrowed_row_counts_zero_one_and_many_compile_once_and_match_eager():
    from tscompile.backend import tracing_config
    m = _Narrowed()
    compiled = torch.compile(m, backend="tscompile", dynamic=True)
    cases = [  # (q_lens, completes, rows kept)
        ([0, 0], [True, True], 0),  # every row pads the bucket: nothing kept
        ([5, 0], [False, True], 1),  # an open chunk keeps its last row
        ([4, 3, 6], [True, True, True], 6),
    ]
    before = counters["graphs"]
    for q_lens, completes, kept in cases:
        x = torch.randn(16, 8)  # 16 rows: a token bucket; rows past the requests are padding
        pos = torch.arange(16)
        indptr = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        args = (x, pos, indptr, torch.tensor(completes))
        with tracing_config():
            out = compiled(*args)
        ref = m(*args)
        assert out.shape == (kept, 3)
        torch.testing.assert_close(out, ref)
    assert counters["graphs"] - before == 1


def test_split_sdpa_on_a_stock_transformers_llama_matches_eager(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
        before = counters["breaks"]
        opts = {"split_sdpa": True, "debug_dir": str(tmp_path)}
        out = torch.compile(model, backend="tscompile", options=opts)(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert counters["breaks"] - before == 2  # one per layer
    plans = list(tmp_path.glob("graph_*/plan.txt"))
    assert plans and "scaled_dot_product_attention" in plans[0].read_text()


def test_debug_dump_writes_plan_and_pieces(tmp_path, monkeypatch):
    monkeypatch.setenv("TSCOMPILE_DEBUG_DIR", str(tmp_path))
    torch.compiler.reset()  # an earlier test's compiled step would be reused (its guards still hold)
    llm = make_llm("narrow-tiny")
    ids(llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2)))
    folders = sorted(tmp_path.glob("graph_*"))
    plans = [f / "plan.txt" for f in folders if (f / "split.py").exists()]
    assert plans, list(tmp_path.rglob("*"))
    text = plans[0].read_text()
    assert "narrow" in text and "tscompile::attention" in text
    pieces = list(plans[0].parent.glob("submod_*_compiled.py"))
    assert len(pieces) == 6 and all("def forward" in p.read_text() for p in pieces)


def test_each_engine_compiles_its_own_steps():
    """Dynamo keeps compiled entries on the code object: engines sharing them would recompile
    into the recompile limit (then run eagerly) or replay another engine's prefill graphs."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    params = SamplingParams(max_new_tokens=2)
    first, second = make_llm(), make_llm()
    tokens = ids(first.generate(PROMPTS[:2], params))
    own = first.runner.prefill.compiled.__wrapped__.__code__
    shared = type(first.runner.prefill).forward.__code__
    assert own is not shared and own is not second.runner.prefill.compiled.__wrapped__.__code__
    n_first, n_shared = len(entries(own)), len(entries(shared))  # other tests may have traced `shared`
    assert n_first >= 1
    assert ids(second.generate(PROMPTS[:2], params)) == tokens  # same preset and seed: same tokens
    assert len(entries(own)) == n_first and len(entries(shared)) == n_shared  # nothing landed on either
    assert len(entries(second.runner.prefill.compiled.__wrapped__.__code__)) >= 1


def test_indexing_a_break_output_by_a_later_tensor_splits_without_a_cycle():
    """``attention(q)[..., index]`` with ``index`` made after the break: the indexing belongs to the
    next piece (only a tuple output's int getitem stays with its break)."""
    import operator

    from tscompile.passes.split import split_graph

    def f(q):
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return a[:, :, torch.arange(q.shape[2]).flip(0)] * 2

    gm = torch.fx.symbolic_trace(f)
    split, plan = split_graph(gm, split_ops=(), split_sdpa=True)
    assert [p.kind for p in plan.pieces] == ["break", "compiled"]
    q = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(split(q), f(q))
    compiled = getattr(split, plan.of_kind("compiled")[0].name)
    assert any(n.target is operator.getitem for n in compiled.graph.nodes)  # the indexing runs there
