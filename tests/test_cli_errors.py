"""Bad command lines end as one ``tscompile:`` line on stderr and exit code 2, never a traceback,
and before any model is built."""

from __future__ import annotations

import pytest
import torch

from tscompile.cli import main, parse_prompt_ids


def _refused(capsys, argv: list[str], *messages: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tscompile: "), captured.err
    assert all(m in lines[0] for m in messages), captured.err


@pytest.mark.parametrize("text,message", [
    ("1,,2", "empty item"),
    ("1,2,", "empty item"),
    ("", "one or more token ids"),
    ("1,-2", "token ids must be >= 0, got -2"),
    ("-5", "token ids must be >= 0, got -5"),
    ("1,x", "got 'x'"),
    ("1.5", "got '1.5'"),
    ("1, 2 3", "got '2 3'"),
])
def test_bad_prompt_ids_refused(capsys, text, message):
    _refused(capsys, ["generate", "--prompt-ids", text, "--device", "cpu"], "--prompt-ids", message)


@pytest.mark.parametrize("text,ids", [("1,2,3", [1, 2, 3]), ("1, 2 ,3", [1, 2, 3]), ("4 5  6", [4, 5, 6]),
                                      ("0", [0])])
def test_prompt_ids_by_commas_or_spaces(text, ids):
    assert parse_prompt_ids(text) == ids


def test_device_mps_refused(capsys):
    _refused(capsys, ["generate", "--device", "mps"], "device 'mps' is not supported")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
def test_device_cuda_refused_without_cuda(capsys):
    _refused(capsys, ["generate", "--device", "cuda"], "this torch build sees no CUDA device")


@pytest.mark.parametrize("flag,value", [("--page-size", "0"), ("--max-num-seqs", "-1"), ("--max-model-len", "0")])
def test_non_positive_sizes_refused(capsys, flag, value):
    name = flag.removeprefix("--").replace("-", "_")
    _refused(capsys, ["generate", "--device", "cpu", flag, value], f"{name} must be ", f"an int >= 1, got {value}")


def test_seed_out_of_range_refused(capsys):
    _refused(capsys, ["generate", "--device", "cpu", "--seed", str(2**63)], "seed must be an int in [0, 2**63)")


def test_run_package_bad_arguments_refused_before_loading(capsys, tmp_path):
    absent = str(tmp_path / "absent.pt2")  # never opened: the arguments are refused first
    _refused(capsys, ["run-package", absent, "--prompt-ids", "3,,4"], "empty item")
    _refused(capsys, ["run-package", absent, "--max-num-seqs", "0"], "max_num_seqs must be None or an int >= 1")
    _refused(capsys, ["run-package", absent, "--device", "mps"], "device 'mps' is not supported")


def test_export_bad_arguments_refused_before_building(capsys, tmp_path):
    out = str(tmp_path / "m.pt2")
    _refused(capsys, ["export", "--out", out, "--device", "cpu", "--page-size", "0"], "page_size must be an int >= 1")
    _refused(capsys, ["export", "--out", out, "--device", "cpu", "--max-num-batched-tokens", "-3"],
             "max_num_batched_tokens must be an int >= 1")


def test_sampling_seed_out_of_range_refused(capsys):
    _refused(capsys, ["generate", "--device", "cpu", "--sampling-seed", str(2**64)],
             "--sampling-seed must be an int in [0, 2**63), got 18446744073709551616")
    _refused(capsys, ["generate", "--device", "cpu", "--sampling-seed", "-1"], "--sampling-seed must be an int")


def test_refusal_wrapped_by_torch_is_one_line(capsys, monkeypatch):
    """A refusal raised inside the backend reaches the CLI wrapped (torch's BackendCompilerFailed keeps
    it as ``inner_exception``, raised ``from None``); it still prints as its one line."""
    from torch._dynamo.exc import BackendCompilerFailed

    import tscompile.generate_cli as cli

    def compile_fails(args):
        inner = ValueError("tscompile: piece_compiler='tensorrt' needs torch-tensorrt\nsecond line")
        raise BackendCompilerFailed(lambda: None, inner, None) from None

    monkeypatch.setattr(cli, "run", compile_fails)
    _refused(capsys, ["generate"], "piece_compiler='tensorrt' needs torch-tensorrt")


def test_other_errors_still_raise(monkeypatch):
    import tscompile.generate_cli as cli

    def broken(args):
        raise RuntimeError("a bug, not a refusal")

    monkeypatch.setattr(cli, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate"])


def test_the_cli_shows_tscompile_info_lines(capsys):
    """The library adds no handler; the CLI shows tscompile's INFO lines on stderr."""
    import logging

    from tscompile.cli import show_tscompile_logs

    show_tscompile_logs()
    logging.getLogger("tscompile").info("Graph capturing finished in 1 s, took 0.01 GiB")
    assert "Graph capturing finished in 1 s" in capsys.readouterr().err


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare word runs


def test_help_texts_say_what_each_command_takes(capsys):
    top = _help(capsys, [])
    for command in ("generate", "chat", "bench", "export", "run-package"):
        assert command in top
    assert "export a model (a local checkpoint directory or a preset name)" in top
    assert "a preset model's" not in top  # export takes checkpoints too
    assert "run-package generate from a .pt2 package written by tscompile export" in top
    for command in ("generate", "chat", "bench", "export"):
        text = _help(capsys, [command])
        assert "checkpoint directory" in text and "--model" in text, command
    assert "--max-new-tokens MAX_NEW_TOKENS, --max-tokens MAX_NEW_TOKENS" in _help(capsys, ["generate"])
    assert "with --show-ids, its token ids after it" in _help(capsys, ["generate"])
    assert "package path, ending in .pt2" in _help(capsys, ["export"])
    assert "git ignores" in _help(capsys, ["bench"])  # where a run writes by default
    assert "--kernel-table, --profile" in _help(capsys, ["bench"])


def test_the_model_is_given_as_an_argument_or_with_model_not_both(capsys):
    _refused(capsys, ["generate", "llama-tiny", "--model", "llama-1b", "--device", "mps"],
             "two models given, 'llama-tiny' and --model 'llama-1b'")
    # one model, given either way, goes on to the engine's own checks (here: the device)
    for argv in (["generate", "llama-tiny", "--device", "mps"], ["generate", "--model", "llama-tiny", "--device", "mps"],
                 ["generate", "llama-tiny", "--model", "llama-tiny", "--device", "mps"]):
        _refused(capsys, argv, "mps")
