"""Text in, text out through the engine, on a tiny Llama checkpoint written by transformers with a
tokenizer trained here: greedy tokens and end-of-sequence handling equal transformers' generate,
stop strings and stop ids, min_tokens, streaming, chat, abort, and a failing step that leaves the
engine clean. Asynchronous scheduling on and off give the same outputs."""

import pytest
import torch

import tscompile
from helpers import TEXTS, assert_text_package_stops_like_engine, write_text_checkpoint
from tscompile import SamplingParams
from tscompile.text import apply_chat_template

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_text_checkpoint(tmp_path_factory.mktemp("tiny_llama_text"))


def _engine(path, **kw):
    kw.setdefault("enforce_eager", True)
    return tscompile.LLM(str(path), device="cpu", attention_backend="torch", max_model_len=96, max_num_seqs=4,
                         page_size=4, **kw)


def _hf_greedy(model, tok, text, **kw):
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, pad_token_id=0, **kw)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_text_in_text_out_equals_transformers_greedy_with_its_eos(checkpoint, async_scheduling):
    path, model, tok, eos = checkpoint
    llm = _engine(path, async_scheduling=async_scheduling)
    assert eos in llm.eos_token_ids and llm.tokenizer is not None
    outs = llm.generate(TEXTS, SamplingParams(max_new_tokens=10))
    for text, out in zip(TEXTS, outs):
        c = out.outputs[0]
        assert out.prompt == text and out.prompt_token_ids == tok(text).input_ids
        assert c.token_ids == _hf_greedy(model, tok, text, max_new_tokens=10)
        if c.token_ids[-1] == eos:  # the eos id ends the tokens and is not in the text
            assert c.finish_reason == "stop" and c.text == tok.decode(c.token_ids[:-1], skip_special_tokens=True)
        else:
            assert c.finish_reason == "length" and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    first = outs[0].outputs[0]  # the eos is a token this prompt produces within 4 steps: it stopped early
    assert first.finish_reason == "stop" and first.token_ids[-1] == eos and len(first.token_ids) <= 4
    # every block is free again once the requests finished
    assert all(a.num_free == a.num_blocks - 1 for a in llm.scheduler.allocators)


def test_min_tokens_matches_transformers_min_new_tokens(checkpoint):
    path, model, tok, eos = checkpoint
    for async_scheduling in (True, False):
        got = _engine(path, async_scheduling=async_scheduling).generate(
            TEXTS[0], SamplingParams(max_new_tokens=10, min_tokens=6))[0].outputs[0]
        assert got.token_ids == _hf_greedy(model, tok, TEXTS[0], max_new_tokens=10, min_new_tokens=6)
        assert eos not in got.token_ids[:6]


def test_ignore_eos_runs_to_the_length(checkpoint):
    path, model, tok, eos = checkpoint
    c = _engine(path).generate(TEXTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 8 and c.finish_reason == "length" and eos in c.token_ids[:4]
    assert c.token_ids == _hf_greedy(model, tok, TEXTS[0], max_new_tokens=8, eos_token_id=None)


def test_stop_strings_and_stop_ids_with_async_scheduling_on_and_off(checkpoint):
    path, model, tok, eos = checkpoint
    full = _engine(path).generate(TEXTS[1], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[2]
    stop_text = tok.decode(full.token_ids[4:6])
    cut = full.text.find(stop_text)
    assert stop_text and cut >= 0
    for async_scheduling in (True, False):
        llm = _engine(path, async_scheduling=async_scheduling)
        by_id, by_text = llm.generate([TEXTS[1], TEXTS[1]], [
            SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(max_new_tokens=10, ignore_eos=True, stop=[stop_text])])
        a, b = by_id.outputs[0], by_text.outputs[0]
        first = full.token_ids.index(stop_id)
        assert a.token_ids == full.token_ids[: first + 1] and a.finish_reason == "stop" and a.stop_reason == stop_id
        assert b.text == full.text[:cut] and b.finish_reason == "stop" and b.stop_reason == stop_text
        assert b.token_ids == full.token_ids[: len(b.token_ids)] and len(b.token_ids) <= 6
        assert all(al.num_free == al.num_blocks - 1 for al in llm.scheduler.allocators)


def test_streamed_text_equals_the_final_text_and_an_abandoned_stream_frees_its_blocks(checkpoint):
    path, *_ = checkpoint
    llm = _engine(path)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    final = llm.generate(TEXTS[2], params)[0].outputs[0].text
    deltas = list(llm.stream(TEXTS[2], params))
    assert "".join(deltas) == final and len(deltas) > 1
    stream = llm.stream(TEXTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    next(stream)
    stream.close()  # abandoned after the first piece of text
    assert not llm.has_unfinished()
    assert all(a.num_free == a.num_blocks - 1 for a in llm.scheduler.allocators)


def test_chat_applies_the_template(checkpoint):
    path, _, tok, _ = checkpoint
    llm = _engine(path)
    messages = [{"role": "user", "content": "Hello world!"}]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    reply = llm.chat(messages, params)
    ids = apply_chat_template(tok, messages)
    assert reply.prompt_token_ids == ids
    assert reply.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids


def test_a_string_is_one_prompt_and_needs_a_tokenizer(checkpoint):
    path, *_ = checkpoint
    assert len(_engine(path).generate("123", SamplingParams(max_new_tokens=2))) == 1
    preset = tscompile.LLM("llama-tiny", device="cpu", enforce_eager=True, attention_backend="torch",
                           max_model_len=32, max_num_seqs=2, page_size=4)
    with pytest.raises(ValueError, match="tscompile: .*tokenizer"):
        preset.generate("123")
    with pytest.raises(ValueError, match="tscompile: stop=.* needs a tokenizer"):
        preset.generate([[1, 2]], SamplingParams(stop=["x"]))
    assert not preset.has_unfinished()


def test_abort_frees_the_blocks_and_drops_the_token_in_flight(checkpoint):
    path, *_ = checkpoint
    llm = _engine(path)
    req = llm.add_request(TEXTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(3):
        llm.step()  # a decode still in flight
    llm.abort(req.rid)
    llm.sync()
    assert req.completion.finish_reason == "abort" and len(req.output) <= 3
    assert not llm.has_unfinished() and all(a.num_free == a.num_blocks - 1 for a in llm.scheduler.allocators)


def test_a_failing_step_leaves_the_engine_clean_for_the_next_call(checkpoint):
    path, *_ = checkpoint
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    fresh = _engine(path).generate(TEXTS, params)
    llm = _engine(path)
    real, calls = llm.runner.launch, []

    def fail_third(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*a)

    llm.runner.launch = fail_third
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(TEXTS, params)
    assert not llm.has_unfinished() and not llm.scheduler.waiting and not llm.scheduler.running
    assert all(a.num_free == a.num_blocks - 1 for a in llm.scheduler.allocators)
    again = llm.generate(TEXTS, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]


def _cli(path, *extra):
    return ["--model", str(path), "--device", "cpu", "--enforce-eager", "--attention-backend", "torch",
            "--max-model-len", "96", "--max-num-seqs", "2", "--page-size", "4", "--max-new-tokens", "6",
            "--ignore-eos", *extra]


def test_cli_generate_prints_text_streams_it_and_chats(checkpoint, capsys, monkeypatch):
    import io

    from tscompile.cli import main

    path, *_ = checkpoint
    expect = _engine(path).generate(TEXTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].outputs[0]
    assert main(["generate", *_cli(path, "--prompt", TEXTS[0], "--show-ids")]) == 0
    out = capsys.readouterr().out
    assert f"[0] {expect.text}\n" in out and " ".join(map(str, expect.token_ids)) in out
    assert main(["generate", *_cli(path, "--prompt", TEXTS[0], "--stream")]) == 0
    assert capsys.readouterr().out == expect.text + "\n"
    messages = [{"role": "user", "content": "Hello world!"}]
    reply = _engine(path).chat(messages, SamplingParams(max_new_tokens=6, ignore_eos=True)).outputs[0].text
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello world!\n\n"))
    assert main(["chat", *_cli(path)]) == 0
    assert capsys.readouterr().out == reply + "\n"


def test_cli_stream_with_show_ids_prints_the_text_then_the_ids(checkpoint, capsys):
    from tscompile.cli import main

    path, *_ = checkpoint
    for stop_early in (False, True):  # run to the length limit, and stop at the checkpoint's eos
        extra = ("--max-tokens", "6") if stop_early else ()  # vLLM's spelling of --max-new-tokens
        params = SamplingParams(max_new_tokens=6, ignore_eos=not stop_early)
        expect = _engine(path).generate(TEXTS[0], params)[0].outputs[0]
        args = _cli(path, "--prompt", TEXTS[0], "--stream", "--show-ids", *extra)
        if stop_early:
            args.remove("--ignore-eos")
        assert main(["generate", *args]) == 0
        ids = " ".join(map(str, expect.token_ids))
        assert capsys.readouterr().out == f"{expect.text}\nids: {ids} ({expect.finish_reason})\n"
    assert expect.finish_reason == "stop"


def test_cli_stream_with_show_ids_prints_ids_for_a_model_without_a_tokenizer(capsys):
    from tscompile.cli import main

    prompt = [1, 15, 27, 3]
    expect = tscompile.LLM("llama-tiny", device="cpu", enforce_eager=True, attention_backend="torch",
                           max_model_len=64, max_num_seqs=2).generate([prompt], SamplingParams(max_new_tokens=5))
    ids = " ".join(map(str, expect[0].outputs[0].token_ids))
    assert main(["generate", "llama-tiny", "--device", "cpu", "--enforce-eager", "--attention-backend",
                 "torch", "--max-model-len", "64", "--max-num-seqs", "2", "--prompt-ids", "1,15,27,3",
                 "--max-new-tokens", "5", "--stream", "--show-ids"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [ids, f"ids: {ids} (length)"]


@pytest.mark.slow
def test_a_package_exported_from_a_checkpoint_carries_its_tokenizer_and_stop_ids(checkpoint, tmp_path):
    from tscompile.export import export_package

    path, _, tok, eos = checkpoint
    out = tmp_path / "tiny.pt2"
    export_package(str(path), out, device="cpu", max_num_seqs=2, max_model_len=64, page_size=4, verify=False)
    assert_text_package_stops_like_engine(tscompile.load_package(out), _engine(path), tok, eos)
