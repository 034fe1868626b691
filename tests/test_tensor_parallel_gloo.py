"""Tensor parallelism over gloo on the CPU: two processes give the one-process engine's greedy tokens
(and prefill logits) in float32, for Llama and Qwen3 checkpoints written by transformers, with a KV
head per rank and with one KV head replicated on both ranks; eager and compiled. Also: the
collectives under Inductor, ``torchrun``, a worker that dies, and ``close``.

Every engine here spawns one worker process (a second rank): the engines are module-scoped, the
models tiny, the workers single-threaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import weakref

import pytest
import torch

import tscompile
from tscompile import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[17, 4], [5, 250, 3, 99, 42], list(range(7, 20)), [(i * 37) % 300 for i in range(23)]]
NEW_TOKENS = 5
ENGINE = dict(device="cpu", attention_backend="torch", max_model_len=64, max_num_seqs=4, page_size=4,
              max_num_batched_tokens=32)  # the longer prompts prefill in chunks: extend, mixed and decode steps
TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
FAMILIES = {  # llama: one KV head per rank; qwen3: one KV head, replicated on both ranks
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Spawned workers take this process's thread count: one each, on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for seed, (family, (config_cls, model_cls, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(seed)
        hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**TINY, **extra)).eval()
        with torch.no_grad():  # O(1)-scale weights: sharp logits, so a split mistake changes tokens
            for name, p in hf.named_parameters():
                r = torch.randn(p.shape)
                p.copy_(1 + 0.3 * r if "norm" in name else r if "embed" in name else r / p.shape[-1] ** 0.5)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        out[family] = str(path)
    return out


def run(llm) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per prompt, and the first step's logits (rank 0's gathered LM-head output)."""
    captured = []
    hook = llm.model.output.register_forward_hook(lambda m, a, out: captured.append(out.detach().float().clone()))
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    finally:
        hook.remove()
    return [o.outputs[0].token_ids for o in outs], (captured[0] if captured else None)


@pytest.fixture(scope="module")
def references(checkpoints):
    return {family: run(tscompile.LLM(path, enforce_eager=True, **ENGINE)) for family, path in checkpoints.items()}


def assert_like_one_process(llm, reference) -> None:
    assert llm.model.config.n_heads == 2 and llm.model.config.n_kv_heads == 1  # rank 0's shard
    tokens, logits = run(llm)
    ref_tokens, ref_logits = reference
    assert logits.shape == ref_logits.shape and logits.shape[1] == TINY["vocab_size"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # prompts tell apart: not a constant stream


def test_llama_two_ranks_give_the_one_process_tokens_then_a_dead_worker_is_reported(checkpoints, references):
    """One KV head per rank. Then the worker is killed: rank 0 names the failure, then refuses."""
    llm = tscompile.LLM(checkpoints["llama"], enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    try:
        assert_like_one_process(llm, references["llama"])
        with pytest.raises(ValueError, match="^tscompile: another tensor-parallel engine of this process"):
            tscompile.LLM(checkpoints["llama"], enforce_eager=True, tensor_parallel_size=2, **ENGINE)
        (pid,) = llm.runner.workers.pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tscompile: a tensor-parallel worker failed during a step on rank 0"):
            llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        with pytest.raises(RuntimeError, match="tscompile: the tensor-parallel engine stopped after a failed step"):
            llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    finally:
        llm.close()


def test_qwen3_two_ranks_share_one_kv_head_and_give_the_one_process_tokens_then_close(checkpoints, references):
    """One KV head, replicated on both ranks. Then ``close`` ends the worker cleanly."""
    llm = tscompile.LLM(checkpoints["qwen3"], enforce_eager=True, tensor_parallel_size=2, **ENGINE)
    try:
        assert_like_one_process(llm, references["qwen3"])
    finally:
        processes = llm.runner.workers.context.processes
        control = weakref.ref(llm.runner.group.control)
        llm.close()
    assert not any(p.is_alive() for p in processes)
    assert [p.exitcode for p in processes] == [0]
    # the control group is freed by close, not left to the interpreter's exit (where its gloo threads
    # could be destroyed unjoined and abort a process that had finished its work)
    assert control() is None and llm.runner.group.control is None
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="tscompile: the tensor-parallel engine is closed"):
        llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))


def test_compiled_two_ranks_with_a_replicated_kv_head_give_the_one_process_tokens(checkpoints, references):
    """Dynamo traces the collectives into the engine's steps and the FX split keeps them in the pieces
    (``piece_compiler="eager"`` runs the traced pieces; Inductor's lowering of the same collectives is
    tested below, on the layers alone, a far smaller compile)."""
    llm = tscompile.LLM(checkpoints["qwen3"], tensor_parallel_size=2, compile_options={"piece_compiler": "eager"},
                        **ENGINE)
    try:
        assert run(llm)[0] == references["qwen3"][0]
        assert llm.compile_seconds > 0
    finally:
        llm.close()


def _inductor_layers(rank: int, port: int, results) -> None:
    """Rank ``rank`` of 2: the sharded embedding, a row-parallel linear and the LM head, compiled by the
    tscompile backend (Inductor pieces) and run eagerly; the logits to compare, to ``results``."""
    import torch.distributed as dist

    from tscompile.models.parallel import ShardLayout, TensorParallel, embedding, lm_head, row_linear

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # the test process holds the store
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        cfg = tscompile.models.build_config("llama-tiny", vocab_size=301)
        tp = TensorParallel(rank, 2, dist.group.WORLD.group_name)
        layout = ShardLayout(cfg, rank, 2)
        torch.manual_seed(0)  # the whole layers' weights, the same on both ranks; each keeps its shard
        full = {"tok_embeddings.weight": torch.randn(cfg.vocab_size, cfg.dim),
                "layers.0.feed_forward.w2.weight": torch.randn(cfg.dim, cfg.intermediate_size) / 20,
                "output.weight": torch.randn(cfg.vocab_size, cfg.dim) / 10}
        emb, head = embedding(cfg, tp), lm_head(cfg, tp)
        down = row_linear(cfg.intermediate_size // 2, cfg.dim, tp)
        with torch.no_grad():
            for module, name in ((emb, "tok_embeddings.weight"), (down, "layers.0.feed_forward.w2.weight"),
                                 (head, "output.weight")):
                module.weight.copy_(layout.shard(name, full[name]))
        mlp_in = torch.randn(5, cfg.intermediate_size)  # the MLP's whole input; each rank takes its columns

        def step(ids, x):
            return head(emb(ids) + down(x))

        ids = torch.tensor([0, 150, 151, 300, 17])  # ids on both sides of the split, and the last one
        x = layout.shard("layers.0.feed_forward.w2.weight", mlp_in)  # [5, intermediate / 2]
        with torch.no_grad():
            compiled = torch.compile(step, backend="tscompile", dynamic=True)(ids, x)
            eager = step(ids, x)
            whole = (full["tok_embeddings.weight"][ids] + mlp_in @ full["layers.0.feed_forward.w2.weight"].T) \
                @ full["output.weight"].T
        results[rank] = (compiled, eager, whole)
    finally:
        dist.destroy_process_group()


def test_the_collectives_compile_with_inductor_under_gloo():
    ctx = torch.multiprocessing.get_context("spawn")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    with ctx.Manager() as manager:
        results = manager.dict()
        workers = [ctx.Process(target=_inductor_layers, args=(rank, store.port, results)) for rank in (0, 1)]
        for w in workers:
            w.start()
        try:
            for w in workers:
                w.join(600)
            assert [w.exitcode for w in workers] == [0, 0]
        finally:
            for w in workers:
                if w.is_alive():
                    w.kill()
        results = dict(results)
    for rank in (0, 1):
        compiled, eager, whole = results[rank]
        assert compiled.shape == (5, 301)
        torch.testing.assert_close(eager, whole, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # every rank holds the same logits


TORCHRUN_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
import tscompile
if __name__ == "__main__":
    llm = tscompile.LLM(sys.argv[1], enforce_eager=True, tensor_parallel_size=2, **json.loads(sys.argv[2]))
    outs = llm.generate(json.loads(sys.argv[3]), tscompile.SamplingParams(max_new_tokens=%d))
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    llm.close()
""" % NEW_TOKENS


def test_torchrun_ranks_serve_rank_zero(checkpoints, references, tmp_path):
    """Under torchrun each process is a rank: rank 0 generates, rank 1 serves inside the constructor and
    ends when rank 0 closes."""
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(checkpoints["llama"]), json.dumps(ENGINE), json.dumps(PROMPTS)],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(printed) == 1  # rank 0 only
    assert json.loads(printed[0].removeprefix("TOKENS ")) == references["llama"][0]
