"""Shared test fixtures: random paged batches and a dense (unpaged) attention reference."""

from __future__ import annotations

import numpy as np
import torch

import tscompile


def random_paged_batch(q_lens, kv_lens, *, page_size, num_kv_heads=2, group=2, head_dim=16,
                       dtype=torch.float32, device="cpu", seed=0, pad_rows=0):
    """A ragged batch where every request owns distinct pages (no shared slots).

    Returns a dict with q, k, v (the new rows), k_cache/v_cache (random, prefix already in place),
    page_table, seq_lens, qo_indptr, write_loc, and the dense per-request K/V for a reference.
    ``pad_rows`` appends padded requests (seq_len 0, null page table, write slot 0)."""
    g = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    max_pages = max(-(-max(kv_lens) // page_size), 1) + 1
    pages_needed = sum(-(-kv // page_size) for kv in kv_lens)
    num_pages = pages_needed + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # never page 0
    hq = num_kv_heads * group
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    page_table = torch.zeros(B + pad_rows, max_pages, dtype=torch.int32)
    for b, kv in enumerate(kv_lens):
        n = -(-kv // page_size)
        page_table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    T = sum(q_lens)
    q = torch.randn(T + pad_rows, hq, head_dim, generator=g).to(dtype)
    k = torch.randn(T + pad_rows, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T + pad_rows, num_kv_heads, head_dim, generator=g).to(dtype)
    write_loc, dense_k, dense_v = [], [], []
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    row = 0
    for b, (ql, kv) in enumerate(zip(q_lens, kv_lens)):
        slots = [int(page_table[b, p // page_size]) * page_size + p % page_size for p in range(kv)]
        write_loc += slots[kv - ql:]
        dk, dv = flat_k[slots].clone(), flat_v[slots].clone()
        dk[kv - ql:] = k[row:row + ql]
        dv[kv - ql:] = v[row:row + ql]
        dense_k.append(dk)
        dense_v.append(dv)
        row += ql
    write_loc += [0] * pad_rows
    seq_lens = torch.tensor(list(kv_lens) + [0] * pad_rows, dtype=torch.int32)
    qo = torch.tensor([0] + list(q_lens) + [1] * pad_rows).cumsum(0).to(torch.int32)
    to = dict(device=device)
    return dict(
        q=q.to(**to), k=k.to(**to), v=v.to(**to), k_cache=k_cache.to(**to), v_cache=v_cache.to(**to),
        page_table=page_table.to(**to), seq_lens=seq_lens.to(**to), qo_indptr=qo.to(**to),
        write_loc=torch.tensor(write_loc, dtype=torch.int64, device=device),
        dense_k=dense_k, dense_v=dense_v, q_lens=list(q_lens), kv_lens=list(kv_lens),
    )


def dense_reference(batch, scale):
    """float64 causal attention on the unpaged K/V; returns [T, Hq, D] (padded rows: zeros)."""
    q = batch["q"].double().cpu()
    outs = []
    row = 0
    for ql, kv, dk, dv in zip(batch["q_lens"], batch["kv_lens"], batch["dense_k"], batch["dense_v"]):
        hq, hkv = q.shape[1], dk.shape[1]
        keys = dk.double().repeat_interleave(hq // hkv, dim=1)
        vals = dv.double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("thd,shd->hts", q[row:row + ql], keys) * scale
        qpos = torch.arange(kv - ql, kv)
        s = s.masked_fill(torch.arange(kv)[None, :] > qpos[:, None], float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", torch.softmax(s, -1), vals))
        row += ql
    pad = q.shape[0] - row
    outs.append(torch.zeros(pad, *q.shape[1:], dtype=torch.float64))
    return torch.cat(outs)


def run_attention(batch, impl, *, decode, scale=0.25, poison=float("nan")):
    out = torch.full_like(batch["q"], poison)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    torch.ops.tscompile.attention(
        batch["q"], batch["k"], batch["v"], k_cache, v_cache, out, batch["page_table"], batch["seq_lens"],
        batch["qo_indptr"], batch["write_loc"], scale, decode, impl,
    )
    return out, k_cache, v_cache


def record_modes(llm) -> list:
    """Spy on an engine: the forward mode of every step it runs, in order."""
    seen = []
    original = llm.runner.launch

    def spy(plan, prev_rows=None):
        seen.append(plan.mode)
        return original(plan, prev_rows)

    llm.runner.launch = spy
    return seen


PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 250, 11], [300], list(range(1, 20)), [77, 66, 55]]


def record_built_models(monkeypatch) -> list:
    """The model object of every ``tscompile.LLM`` built from now on, in order."""
    built = []
    real = tscompile.LLM.__init__

    def spy(self, model, **kw):
        real(self, model, **kw)
        built.append(self.model)

    monkeypatch.setattr(tscompile.LLM, "__init__", spy)
    return built


def record_inductor_patches(monkeypatch) -> list[dict]:
    """The ``config_patches`` of every Inductor compile from now on (``compile_fx`` re-enters itself
    without patches once they are applied; those calls are not recorded)."""
    import torch._inductor.compile_fx as cfx

    seen: list[dict] = []
    real = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        if config_patches:
            seen.append(dict(config_patches))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


def small_llm(model="llama-tiny", **kw):
    """A CPU engine small enough for tests; callers choose dtype and enforce_eager."""
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("page_size", 4)
    kw.setdefault("device", "cpu")
    kw.setdefault("attention_backend", "torch")
    return tscompile.LLM(model, **kw)


def ids(outputs) -> list[list[int]]:
    """The generated token ids of each ``RequestOutput`` (one completion per request)."""
    return [o.outputs[0].token_ids for o in outputs]


SENTENCES = ["Hello world! The quick brown fox jumps over the lazy dog.", "Café naïve résumé, déjà vu.",
             "我们喜欢机器学习。你好，世界！", "Emoji time 🎉🚀 and 😀 smiles 👍🏽", "日本語のテキストも少し。"]
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(path, chat_template=True):
    """A tiny byte-level BPE trained here (emoji and CJK text included), saved with transformers;
    nothing is downloaded. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


TEXTS = ["Hello world! The quick", "Café naïve 我们喜欢", "Emoji time 🎉"]


def write_text_checkpoint(path):
    """A tiny Llama checkpoint written by transformers beside ``save_tokenizer``'s tokenizer, whose
    end-of-sequence id is a token the model really produces: the 4th greedy token of ``TEXTS[0]``
    (transformers, CPU, float32), so a run of that prompt stops there. Returns ``(path, the
    transformers model, its tokenizer, that eos id)``; nothing is downloaded."""
    import transformers

    save_tokenizer(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    eos = int(out[0, ids.shape[1] + 3])
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return path, model, tok, eos


def assert_text_package_stops_like_engine(package, engine, tok, eos: int, max_new_tokens: int = 10) -> None:
    """A package exported from ``write_text_checkpoint``'s checkpoint against the engine on that
    checkpoint: it carries the checkpoint's tokenizer and stop ids, encodes text prompts and decodes
    its outputs with that tokenizer, and stops where the engine stops, token for token: at the eos
    id, past it under ``min_tokens`` (the packaged sampler masks it), and at a requested stop id."""
    from tscompile import SamplingParams

    record = package.package.record
    assert "tokenizer.json" in record["tokenizer_files"] and package.tokenizer is not None
    assert tuple(record["eos_token_ids"]) == package.eos_token_ids == engine.eos_token_ids
    assert eos in package.eos_token_ids and tok.eos_token_id in package.eos_token_ids
    full = engine.generate(TEXTS[0], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))[0].outputs[0]
    assert eos in full.token_ids[:-1], "the checkpoint's eos must be a token this prompt produces early"
    first_eos = min(i for i, t in enumerate(full.token_ids) if t in package.eos_token_ids)
    stop_id = next(t for t in full.token_ids if t not in package.eos_token_ids)
    prompts = [*TEXTS, TEXTS[0], TEXTS[0]]
    params = [SamplingParams(max_new_tokens=max_new_tokens)] * len(TEXTS) + [
        SamplingParams(max_new_tokens=max_new_tokens, min_tokens=first_eos + 1),
        SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, stop_token_ids=[stop_id])]
    got, want = package.generate(prompts, params), engine.generate(prompts, params)
    for g, w, text in zip(got, want, prompts):
        assert g.prompt == text and g.prompt_token_ids == w.prompt_token_ids == tok(text).input_ids
        c, d = g.outputs[0], w.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
               (d.token_ids, d.text, d.finish_reason, d.stop_reason), text
        kept = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids  # a stop id is not in the text
        assert c.text == tok.decode(kept, skip_special_tokens=True)
    by_eos, masked, by_id = (o.outputs[0] for o in got[0:1] + got[-2:])
    assert by_eos.token_ids == full.token_ids[:first_eos + 1]
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason is None
    assert masked.token_ids[:first_eos] == full.token_ids[:first_eos]
    assert not set(masked.token_ids[:first_eos + 1]) & set(package.eos_token_ids)
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1] and by_id.stop_reason == stop_id


def assert_other_releases_refused(path, monkeypatch):
    """``load_package`` refuses a package built by another torch or tscompile release, naming both."""
    import re

    import pytest

    import tscompile.version
    built = re.escape(torch.__version__)
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.99.0")
        with pytest.raises(ValueError, match=rf"^tscompile: .*built with torch {built}, this is torch 2\.99\.0"):
            tscompile.load_package(path)
    with monkeypatch.context() as m:
        m.setattr(tscompile.version, "__version__", "0.9.0")
        with pytest.raises(ValueError, match=rf"^tscompile: .*built with tscompile {re.escape(tscompile.__version__)}"
                                             r".*tscompile 0\.9\.0"):
            tscompile.load_package(path)


def one_thread_fixture():
    """A tiny model gains nothing from intra-op threads, and on a shared host they only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_scheduled_batch(rng, specs, *, max_blocks: int, sampling, max_generated: int = 4, rid_base: int = 0):
    """A random ``ScheduledBatch`` and its per-group block tables: extends (some completing their
    prompt, some not) then decodes (some with the last token still on the device), each request
    owning its own table row. ``sampling(rng)`` draws each request's ``SamplingParams``; decodes have
    generated 1..``max_generated`` tokens."""
    from tscompile.runtime.scheduler import Request
    from tscompile.runtime.step_builder import ScheduledBatch

    n_ext, n_dec = int(rng.integers(0, 4)), int(rng.integers(0, 4))
    n_dec = max(n_dec, 1 - n_ext)
    tables = [(rng.permutation(8 * max_blocks) + 1).astype(np.int32).reshape(8, max_blocks) for _ in specs]
    extends, decodes = [], []
    for i in range(n_ext + n_dec):
        plen = int(rng.integers(1, 20))
        params = sampling(rng)
        r = Request(rid_base + i, [int(x) for x in rng.integers(1, 500, plen)], params,
                    seed=int(rng.integers(0, 2**62)), slot=i)
        if i < n_ext:
            r.num_computed = int(rng.integers(0, plen))
            r.group_lens = [r.num_computed] + [int(rng.integers(0, 3))] * (len(specs) - 1)
            extends.append((r, int(rng.integers(1, plen - r.num_computed + 1))))
        else:
            gen = int(rng.integers(1, max_generated + 1))
            r.num_computed, r.num_generated = plen + gen - 1, gen
            r.output = [int(x) for x in rng.integers(1, 500, gen - int(rng.integers(0, 2)))]  # maybe one unread
            r.group_lens = [r.num_computed] + [int(rng.integers(1, 6))] * (len(specs) - 1)
            decodes.append(r)
    return ScheduledBatch(extends, decodes), tables


class LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel: ``spy[grid](*args, **kwargs)`` records the grid and the
    keyword arguments (constexprs, num_warps, ...) and launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({"grid": grid, **kwargs})
            return self.kernel[grid](*args, **kwargs)
        return launch


def flip_byte(path, offset: int) -> None:
    """Invert one byte of a file in place (damage for the integrity checks)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def member_offset(path, name: str) -> int:
    """Where zip member ``name``'s data starts in the archive (after its local header)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


def assert_pdl_graph_gives_the_plain_bits(sources: dict, set_pdl, make_op, seeds=(1, 2, 3)) -> list:
    """A PDL launch checked where PDL can go wrong: ``make_op(live)`` -> (op, outputs, keep) builds an op
    over the ``live`` copies of ``sources`` writing ``outputs`` (output first, poisoned with NaN before
    every replay; then any cache it writes); each op is captured in a CUDA graph right after the kernels
    that write ``live`` (``torch.mul``), once with ``set_pdl(False)`` and once with ``set_pdl(True)``.
    For each seed, new sources and one replay of each: every output bitwise the same (a PDL program that
    read its inputs before its ``gdc_wait`` would see the previous replay's). Returns the plain graph's
    outputs per seed for the caller's own checks. ``keep`` is whatever else the graph reads or writes:
    a graph holds raw pointers only, so those must outlive it (or the next capture reuses their blocks)."""
    from tscompile.bench.graph_timing import capture_graph

    graphs = []
    for pdl in (False, True):
        set_pdl(pdl)
        live = {n: torch.empty_like(t) for n, t in sources.items()}
        op, outputs, keep = make_op(live)

        def step(live=live, op=op):
            for n in live:
                torch.mul(sources[n], 1.0, out=live[n])
            op()

        graphs.append((capture_graph(step), outputs, (live, keep)))
    device = next(iter(sources.values())).device
    plain_outputs = []
    for seed in seeds:
        g = torch.Generator(device).manual_seed(seed)
        for t in sources.values():
            t.copy_(torch.randn(t.shape, generator=g, device=device))
        results = []
        for graph, outputs, _keep in graphs:
            outputs[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            results.append([t.clone() for t in outputs])
        for i, (got, want) in enumerate(zip(*results)):
            bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
            assert torch.equal(got.view(bits), want.view(bits)), f"seed {seed}: the PDL graph's output {i} differs"
        plain_outputs.append(results[0])
    return plain_outputs


def post_grad_passes(patches: dict) -> list:
    """The passes in Inductor patches' ``post_grad_custom_post_pass`` slot, in order (a ``PassChain``
    opened), [] when it is empty."""
    from tscompile.passes.pass_chain import PassChain

    slot = patches.get("post_grad_custom_post_pass")
    return [] if slot is None else list(slot.passes) if isinstance(slot, PassChain) else [slot]


def our_pass(patches: dict, cls):
    """The one pass of type ``cls`` in the patches' post-grad slot, None when there is none."""
    found = [p for p in post_grad_passes(patches) if isinstance(p, cls)]
    assert len(found) <= 1, found
    return found[0] if found else None


# float32 log-probabilities of one token through two kernel paths (another batch composition, a
# verify window instead of a decode row) differ by about 1e-5: cuBLAS picks its kernel per shape. A
# wrong KV row or position moves them by far more than this.
FLOAT32_NOISE = 1e-4


def top_two(llm, context: list[int]) -> tuple[tuple[int, float], tuple[int, float]]:
    """The greedy pick after ``context`` and the runner-up (the pick once the first is banned: a
    stop token before ``min_tokens``), each with its log-probability under the raw distribution.
    Both are prefills of the whole context (the prefix cache off, so both take the same path). The
    ban covers the model's eos ids too: where one of them is the true runner-up, the third token is
    returned, and a near-tie check fails rather than passes."""
    def pick(**banned):
        params = tscompile.SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True, **banned)
        out = llm.generate([list(context)], params)[0].outputs[0]
        return out.token_ids[0], out.logprobs[0][out.token_ids[0]].logprob
    caching = llm.scheduler.prefix_cache is not None
    llm.scheduler.set_prefix_caching(False)
    try:
        first = pick()
        return first, pick(stop_token_ids=(first[0],), min_tokens=1)
    finally:
        llm.scheduler.set_prefix_caching(caching)


def first_divergences(got: list[list[int]], want: list[list[int]]) -> list[tuple[int, int]]:
    """(request, token) of each request's first token where ``got`` leaves ``want``."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        k = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), None)
        if k is None and len(g) != len(w):
            k = min(len(g), len(w))
        if k is not None:
            out.append((i, k))
    return out


def assert_equal_but_near_ties(got, want, prompts, top_two_of, what: str = "") -> None:
    """``got`` equals the reference ``want`` token for token, except that a request may leave it at a
    float32 near tie: at its first differing token k, the reference's two best tokens after the
    prompt and ``want[:k]`` (``top_two_of(context)``, see ``top_two``) are ``want[k]`` and ``got[k]``
    within ``FLOAT32_NOISE`` of each other. Random-weight models of a large vocabulary have nearly
    flat logits, where such ties occur; a bug moves a token by far more. At most one request in
    eight may differ."""
    assert len(got) == len(want), f"{what}: {len(got)} requests, the reference {len(want)}"
    diverged = first_divergences(got, want)
    lines = []
    for i, k in diverged:
        if k >= min(len(got[i]), len(want[i])):
            raise AssertionError(f"{what}: request {i} has {len(got[i])} tokens, the reference {len(want[i])}")
        (t1, l1), (t2, l2) = top_two_of(list(prompts[i]) + list(want[i][:k]))
        line = (f"request {i} token {k}: reference {want[i][k]}, got {got[i][k]}; the reference's top two "
                f"there: {t1} ({l1:.7f}), {t2} ({l2:.7f})")
        lines.append(line)
        assert {t1, t2} == {want[i][k], got[i][k]} and abs(l1 - l2) <= FLOAT32_NOISE, \
            f"{what}: not a near tie: " + "\n".join(lines)
    assert len(diverged) <= max(1, len(got) // 8), f"{what}: {len(diverged)} of {len(got)} requests differ\n" \
        + "\n".join(lines)


def poison_decode_metadata_at_each_replay(llm) -> list:
    """Right before each decode or verify replay, every decode metadata buffer of the engine gets wrong
    values that are still in range (pages and slots of the first blocks, length 1): a refresh the
    graph holds rewrites them before its forward reads them, one launched before the replay cannot.
    Returns the list the replayed keys go to."""
    from tscompile.runtime.graph_runner import DECODE

    graphs, router = llm.runner.graphs, llm.runner.attention  # on any device: the values are made on the CPU
    replay = graphs.replay_graph
    gen = torch.Generator().manual_seed(0)
    replayed = []

    def poisoned(key):
        replayed.append(key)
        if key.phase == DECODE:
            for leaf in router.leaves:
                leaf.page_table_buf.copy_(torch.randint(1, 4, leaf.page_table_buf.shape, generator=gen))
                leaf.seq_lens_buf.fill_(1)
            router._write_loc_stack.copy_(torch.randint(0, 16, router._write_loc_stack.shape, generator=gen))
        return replay(key)

    graphs.replay_graph = poisoned
    return replayed
