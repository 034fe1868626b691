"""The torch attention kernel (the oracle) against a dense float64 reference, and opcheck."""

import pytest
import torch

from helpers import dense_reference, random_paged_batch, run_attention


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_extend_with_prefix_matches_dense(page_size, seed):
    batch = random_paged_batch([5, 1, 17, 3], [9, 40, 17, 70], page_size=page_size, seed=seed)
    out, _, _ = run_attention(batch, "torch", decode=False)
    ref = dense_reference(batch, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_torch_decode_matches_dense_and_pads_to_zero(page_size):
    batch = random_paged_batch([1, 1, 1], [1, 33, 100], page_size=page_size, seed=3, pad_rows=2)
    out, _, _ = run_attention(batch, "torch", decode=True)
    ref = dense_reference(batch, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@pytest.mark.parametrize("decode", [True, False])
def test_unwritten_slots_never_leak_into_the_output(decode):
    """Slots past seq_len (and the null page) may hold NaN/inf garbage: outputs must ignore them."""
    q_lens = [1, 1, 1] if decode else [2, 1, 4]
    batch = random_paged_batch(q_lens, [3, 18, 7], page_size=16, seed=9, pad_rows=1 if decode else 0)
    live = torch.zeros(batch["k_cache"].shape[0] * 16, dtype=torch.bool)
    for b, kv in enumerate(batch["kv_lens"]):
        for p in range(kv):
            live[int(batch["page_table"][b, p // 16]) * 16 + p % 16] = True
    for name, poison in (("k_cache", float("nan")), ("v_cache", float("inf"))):
        flat = batch[name].view(-1, *batch[name].shape[2:])
        flat[~live] = poison
    out, _, _ = run_attention(batch, "torch", decode=decode)
    torch.testing.assert_close(out.double(), dense_reference(batch, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_path_equals_extend_path_on_single_rows():
    batch = random_paged_batch([1] * 4, [7, 1, 64, 30], page_size=16, seed=5)
    dec, kd, vd = run_attention(batch, "torch", decode=True)
    ext, ke, ve = run_attention(batch, "torch", decode=False)
    torch.testing.assert_close(dec, ext, rtol=1e-6, atol=1e-6)
    assert torch.equal(kd, ke) and torch.equal(vd, ve)


def test_kv_written_at_write_locations_only():
    batch = random_paged_batch([4, 2], [10, 2], page_size=16, seed=7)
    _, k_cache, v_cache = run_attention(batch, "torch", decode=False)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    torch.testing.assert_close(flat_k[batch["write_loc"]], batch["k"])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[batch["write_loc"]] = False
    assert torch.equal(flat_k[untouched], batch["k_cache"].view(-1, *k_cache.shape[2:])[untouched])


def test_unknown_impl_is_refused():
    batch = random_paged_batch([1], [3], page_size=4)
    with pytest.raises(ValueError, match="tscompile: unknown attention impl 'nope'"):
        run_attention(batch, "nope", decode=True)


@pytest.mark.parametrize("decode", [True, False])
def test_opcheck_attention(decode):
    q_lens = [1, 1, 1] if decode else [3, 1, 5]
    batch = random_paged_batch(q_lens, [4, 9, 20], page_size=4, seed=11)
    args = (batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], torch.zeros_like(batch["q"]),
            batch["page_table"], batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], 0.25, decode, "torch")
    torch.library.opcheck(torch.ops.tscompile.attention.default, args)
