"""torch.compile users of backend="tscompile" on a stock transformers Llama (CPU): one compile
across prompt lengths, split pieces equal eager, padding to token buckets never visible, options
validated. The CUDA-graph replay itself is tested in test_user_compile_gpu.py."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile import token_padding, user_graphs

transformers = pytest.importorskip("transformers")

LENGTHS = (17, 32, 100, 512)


def tiny_llama(layers=1):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def unique_graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


def run_lengths(fwd, model, lengths=LENGTHS):
    """Each length's compiled logits against eager; the compiled logits are poisoned first."""
    torch.manual_seed(1)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, 96, (1, n))
            out = torch.full((1, n, 96), float("nan"))
            out.copy_(fwd(input_ids=ids, use_cache=False).logits)
            ref = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"length {n}")


@pytest.mark.parametrize("split_sdpa", [True, False])
def test_dynamic_true_compiles_once_for_every_length(split_sdpa):
    """One Dynamo graph for every length, split or whole. Dynamo's guards do not depend on the piece
    compiler, so the split case runs its pieces eagerly: Inductor's split pieces under dynamic=True
    (logits against eager at four lengths, padded and unpadded) are checked by
    test_padding_to_buckets_is_invisible_and_pieces_run_at_the_bucket; the whole graph here is Inductor's."""
    torch.compiler.reset()
    model = tiny_llama()
    before = unique_graphs()
    options = {"split_sdpa": split_sdpa, **({"piece_compiler": "eager"} if split_sdpa else {})}
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True, options=options)
    run_lengths(fwd, model)
    assert unique_graphs() - before == 1


def test_default_dynamic_compiles_twice_at_most_and_mark_dynamic_once():
    """dynamic=None (the default): Dynamo compiles the first length static and, at the second
    length, once more with the length dynamic (automatic dynamic shapes); never again after that.
    Marking the token dim dynamic before the first call makes it one compile."""
    torch.compiler.reset()
    model = tiny_llama()
    opts = {"split_sdpa": True, "piece_compiler": "eager"}  # Dynamo's guards do not depend on it
    before = unique_graphs()
    run_lengths(torch.compile(model.forward, backend="tscompile", options=opts), model)
    assert unique_graphs() - before == 2

    torch.compiler.reset()
    before = unique_graphs()
    fwd = torch.compile(model.forward, backend="tscompile", options=opts)
    with torch.no_grad():
        for n in LENGTHS:
            ids = torch.randint(0, 96, (1, n))
            torch._dynamo.mark_dynamic(ids, 1)
            torch.testing.assert_close(fwd(input_ids=ids, use_cache=False).logits,
                                       model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    assert unique_graphs() - before == 1


def test_padding_to_buckets_is_invisible_and_the_whole_graph_runs_at_the_bucket(monkeypatch):
    """A transformers decoder's forward: every piece is row-wise (the mask builder's position-id
    gathers read row i into row i) and every break is SDPA over the token rows, so the whole graph
    runs at the bucket, breaks included; the caller sees only its own rows."""
    torch.compiler.reset()
    model = tiny_llama(layers=2)
    resized = []
    orig = token_padding.TokenShapes.resize

    def spy(self, args, rows, pad):
        resized.append((rows, pad))
        return orig(self, args, rows, pad)

    monkeypatch.setattr(token_padding.TokenShapes, "resize", spy)
    opts = {"split_sdpa": True, "cudagraphs": True, "token_ladder": (32, 64, 128)}
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True, options=opts)
    before = dict(counters)
    with user_graphs.pad_without_graphs():
        run_lengths(fwd, model, (17, 32, 100, 200))
    grew = {k: counters[k] - before.get(k, 0) for k in ("user_whole_graphs", "user_padded_runs", "user_live_pieces",
                                                         "user_above_ladder")}
    assert grew == {"user_whole_graphs": 1, "user_padded_runs": 3, "user_live_pieces": 0, "user_above_ladder": 1}
    assert {r for r, pad in resized if pad} == {32, 128}  # 17 -> 32, 32 stays, 100 -> 128; 200 above
    assert {r for r, pad in resized if not pad} == {17, 32, 100}  # only the outputs are sliced back


def test_the_default_cache_is_padded_and_sliced_like_the_logits():
    """use_cache=True: the graph also returns every layer's keys and values; at the bucket they are
    sliced back to the live rows with the logits, and equal eager's."""
    torch.compiler.reset()
    model = tiny_llama(layers=2)
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True,
                        options={"split_sdpa": True, "cudagraphs": True, "token_ladder": (32, 64)})
    before = counters["user_padded_runs"]
    with torch.no_grad(), user_graphs.pad_without_graphs():
        for n in (9, 40):
            ids = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n))
            got, ref = fwd(input_ids=ids, use_cache=True), model(input_ids=ids, use_cache=True)
            torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
            for layer in range(2):
                for side in ("keys", "values"):
                    a = getattr(got.past_key_values.layers[layer], side)
                    b = getattr(ref.past_key_values.layers[layer], side)
                    assert a.shape == b.shape == (1, 2, n, 8)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["user_padded_runs"] - before == 2


class Attend(torch.nn.Module):
    """SDPA over the token rows (dim 2) of ``q``, with or without a mask, then a row-wise op."""

    def __init__(self, is_causal=False):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, mask=None):
        a = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q + 1, attn_mask=mask, is_causal=self.is_causal)
        return a * 2 + 1


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "float"])
def test_attention_at_the_bucket_never_reads_a_padded_key(mask_kind):
    """Bidirectional attention, a boolean and an additive mask given by the caller (padded with
    zeros: 'masked' for a bool, 'attend' for a float) and a causal call: at the bucket, every live row
    attends to exactly its unpadded keys. Without the key mask the padded keys would change the rows."""
    torch.compiler.reset()
    m = Attend(is_causal=mask_kind == "causal")
    fwd = torch.compile(m, backend="tscompile", options={"split_sdpa": True, "cudagraphs": True,
                                                         "piece_compiler": "eager", "token_ladder": (16,)})
    before = counters["user_whole_graphs"], counters["user_padded_runs"]
    gen = torch.Generator().manual_seed(4)
    with user_graphs.pad_without_graphs():
        for n in (5, 11, 16):
            q = torch.randn(1, 2, n, 8, generator=gen)
            torch._dynamo.mark_dynamic(q, 2)
            args = [q]
            if mask_kind == "bool":
                args.append(torch.rand(n, n, generator=gen) > 0.3)
                args[1].diagonal().fill_(True)  # no row without a key
            elif mask_kind == "float":
                args.append(torch.randn(n, n, generator=gen))
            for a in args[1:]:
                torch._dynamo.mark_dynamic(a, 0)
                torch._dynamo.mark_dynamic(a, 1)
            out = torch.full((1, 2, n, 8), float("nan"))
            out.copy_(fwd(*args))
            torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5, msg=f"{mask_kind} at {n} rows")
    assert counters["user_whole_graphs"] - before[0] == 1
    assert counters["user_padded_runs"] - before[1] == 3


def test_without_the_switch_a_cpu_graph_runs_unpadded():
    torch.compiler.reset()
    model = tiny_llama()
    before = counters["user_padded_runs"]
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True,
                        options={"split_sdpa": True, "cudagraphs": True, "piece_compiler": "eager"})
    run_lengths(fwd, model, (17, 40))
    assert counters["user_padded_runs"] == before  # no graphs on the CPU: padding would only cost


def test_generate_under_padding_gives_eager_greedy_tokens():
    torch.compiler.reset()
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        model.forward = torch.compile(model.forward, backend="tscompile", dynamic=True,
                                      options={"split_sdpa": True, "cudagraphs": True, "piece_compiler": "eager"})
        with user_graphs.pad_without_graphs():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.tolist() == ref.tolist()


def test_a_piece_reading_rows_from_the_end_runs_live():
    """x[:, -1:] after a break reads the last row, a padded one once padded: that piece must run
    at the live rows (and the answer stay eager's)."""

    class LastRow(torch.nn.Module):
        def forward(self, q):
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return (a * 2)[:, :, -1:, :] + 1

    torch.compiler.reset()
    before, whole = counters["user_live_pieces"], counters["user_whole_graphs"]
    m = LastRow()
    fwd = torch.compile(m, backend="tscompile", options={"split_sdpa": True, "cudagraphs": True,
                                                         "piece_compiler": "eager", "token_ladder": (16,)})
    with user_graphs.pad_without_graphs():
        for n in (5, 11):
            q = torch.randn(1, 2, n, 8)
            torch._dynamo.mark_dynamic(q, 2)  # only the token dim: other dynamic sizes turn graphs off
            torch.testing.assert_close(fwd(q), m(q))
    assert counters["user_live_pieces"] - before == 1
    assert counters["user_whole_graphs"] == whole  # a live piece: padded piece by piece, not whole


@pytest.mark.parametrize("options, needle", [
    ({"cudagraphs": "yes"}, "cudagraphs must be True or False"),
    ({"token_ladder": [0, 32]}, "token_ladder must be strictly increasing positive ints"),
    ({"token_ladder": "32"}, "token_ladder must be a sequence of ints"),
    ({"split_sdpa": 1}, "split_sdpa must be True or False"),
    ({"bucket_ladder": (32,)}, "unknown option(s) ['bucket_ladder']"),
])
def test_options_are_validated(options, needle):
    with pytest.raises(ValueError, match="^tscompile: ") as e:
        TscompileConfig.from_options(options)
    assert needle in str(e.value)
    with pytest.raises(Exception) as e:  # through torch.compile: Dynamo wraps the backend's error
        torch.compile(torch.nn.Linear(4, 4), backend="tscompile", options=options)(torch.randn(2, 4))
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or getattr(err, "inner_exception", None)
    assert any(isinstance(x, ValueError) and str(x).startswith("tscompile: ") and needle in str(x) for x in chain)


def test_a_capture_is_keyed_by_the_value_of_a_cpu_scalar():
    """A launch reads a CPU scalar input on the host, so a graph captured with one value must not be
    replayed for another: the key holds the bucket and each CPU scalar's value, nothing else."""
    # a weight, a CPU scalar, a one-element vector, an int; sizes are static here (no token symbol)
    shapes = token_padding.TokenShapes([torch.randn(4, 4), torch.tensor(0.5), torch.randn(1), 3], None)
    assert shapes.host_scalars == (1,)
    key = user_graphs._capture_key(32, [torch.randn(4, 4), torch.tensor(0.5), None, 3], shapes)
    assert key == (32, 0.5)
    assert user_graphs._capture_key(32, [torch.randn(4, 4), torch.tensor(0.25), None, 3], shapes) != key
    assert user_graphs._capture_key(64, [torch.randn(4, 4), torch.tensor(0.5), None, 3], shapes) != key


class Gather(torch.nn.Module):
    """Attention, then its rows gathered by an index tensor built from ``arange`` of the token count."""

    def __init__(self, reverse: bool):
        super().__init__()
        self.reverse = reverse

    def forward(self, q):
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        rows = torch.arange(q.shape[2], device=q.device)
        index = rows.flip(0) if self.reverse else rows + 0
        return a[:, :, index] * 2


@pytest.mark.parametrize("reverse", [False, True])
def test_an_arange_index_keeps_the_graph_whole_and_a_reversed_one_runs_live(reverse):
    """Gathering row i into row i (transformers' position-id gathers) is row-wise; the reversed
    index reads the last rows, padded ones at the bucket, so that piece must run at the live rows."""
    torch.compiler.reset()
    m = Gather(reverse)
    fwd = torch.compile(m, backend="tscompile", options={"split_sdpa": True, "cudagraphs": True,
                                                         "piece_compiler": "eager", "token_ladder": (16,)})
    before = counters["user_whole_graphs"], counters["user_live_pieces"]
    with user_graphs.pad_without_graphs():
        for n in (5, 11):
            q = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n))
            torch._dynamo.mark_dynamic(q, 2)
            torch.testing.assert_close(fwd(q), m(q))
    grew = counters["user_whole_graphs"] - before[0], counters["user_live_pieces"] - before[1]
    assert grew == ((0, 1) if reverse else (1, 0))
