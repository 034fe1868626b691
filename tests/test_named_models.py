"""Named downloadable models (``tscompile.models.demo``) without the network: how a name resolves,
the refusal without the demo extra, and that a conversion cut short leaves no checkpoint behind."""

from __future__ import annotations

import importlib.util

import pytest

from tscompile.models import demo, model_config, resolve_model


def test_presets_and_directories_pass_through_and_unknown_names_list_the_named_models(tmp_path):
    assert resolve_model("llama-tiny") == "llama-tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="tscompile: unknown model preset 'no-such-model'.*smollm2-135m-instruct"):
        model_config("no-such-model")


def test_without_the_demo_extra_the_refusal_names_the_install(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(demo.ModelUnavailable, match=r"^tscompile: model 'smollm2-135m-instruct' .*gguf: "
                                                   r"pip install 'tscompile\[demo\]'"):
        demo.checkpoint_dir("smollm2-135m-instruct", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_a_conversion_cut_short_leaves_no_checkpoint(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read")
    monkeypatch.setattr(demo, "_gguf_file", lambda spec, work: (gguf, "licence text"))

    def crash(spec, gguf_path, out, licence_text):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half written
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(demo, "_convert", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="killed"):
        demo.checkpoint_dir("smollm2-135m-instruct", cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m-instruct.lock"]

    def convert(spec, gguf_path, out, licence_text):  # a complete one: the source record is written last
        out.mkdir(parents=True)
        (out / demo.SOURCE_FILE).write_text(
            f'{{"gguf_sha256": "{spec.gguf_sha256}", "conversion_version": {demo.CONVERSION_VERSION}}}')

    monkeypatch.setattr(demo, "_convert", convert)
    path = demo.checkpoint_dir("smollm2-135m-instruct", cache_dir=cache)
    assert path == cache / "smollm2-135m-instruct" and (path / demo.SOURCE_FILE).is_file()
    monkeypatch.setattr(demo, "_convert", crash)  # found complete: not converted again
    assert demo.checkpoint_dir("smollm2-135m-instruct", cache_dir=cache) == path
