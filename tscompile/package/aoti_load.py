"""Loading a package's AOTInductor programs: torch's loader, without ``load_pt2``'s host probe.

``torch.export.pt2_archive._package.load_pt2`` builds one ``AOTIModelPackageLoader`` per program
(which extracts only that program's folder of the archive and dlopens its library: cheap), but
first compares the program's recorded host with this one through
``torch._inductor.codecache.get_device_information``, only to log a warning on a mismatch. That
call runs ``torch._inductor.cpu_vec_isa.pick_vec_isa()``, which on torch 2.11 and 2.12 proves each
vector ISA of this CPU by compiling a probe library and loading it in a fresh
``python -c "import torch; ..."``: ten such children on an AVX-512/AMX host, 27 s with the probe
libraries already compiled and 47 s on an empty Inductor cache (torch 2.11, measured by faking an
AMX CPU's feature flags). Importing ``load_pt2``'s module also imports Dynamo (2 to 5 s).

So the programs are built here with the same loader and arguments as ``load_pt2`` gives them; the
host comparison keeps its warnings but reads the CPU's features from ``torch.cpu`` (cpuinfo, no
compiler, no child process). Weights stored inside the archive are read once and shared by both
programs (``user_managed``), as ``load_pt2`` does.
"""

from __future__ import annotations

import io
import json
import logging
import platform
import sys

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger("tscompile")

_WEIGHTS_DIR = "data/weights/"
_WEIGHTS_CONFIG_SUFFIX = "weights_config.json"
# an ISA word AOTInductor records (``AOTI_CPU_ISA``, upper case) -> does this CPU have it
_CPU_FEATURES = {
    "AVX2": "_is_avx2_supported",
    "AVX512": "_is_avx512_supported",
    "AVX512_VNNI": "_is_vnni_supported",
    "AMX_TILE": "_is_amx_tile_supported",
}


class PackagedProgram:
    """One AOTInductor program of a package, called like the module it was exported from.

    The call flattens its tensor arguments in order and rebuilds the output with the program's
    output spec, parsed once here rather than on every step as torch's ``AOTICompiledModel`` does."""

    def __init__(self, name: str, loader):
        self.name, self.loader = name, loader
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args):
        flat = [x for x in pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self._out_spec)

    def get_metadata(self) -> dict[str, str]:
        return self.loader.get_metadata()

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool = False) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed)


def host_mismatches(metadata: dict[str, str], device: torch.device) -> list[str]:
    """How this host differs from the one a program was compiled on, from its AOTInductor metadata
    (``AOTI_PLATFORM``, ``AOTI_MACHINE``, ``AOTI_CPU_ISA``, ``AOTI_COMPUTE_CAPABILITY``): what
    ``load_pt2`` warns about, with the CPU's features read from cpuinfo instead of compiled probes.
    An ISA counts as missing only when this CPU lacks one of its features (a newer CPU runs code
    built for an older one)."""
    found = []
    for key, here in (("AOTI_PLATFORM", sys.platform), ("AOTI_MACHINE", platform.machine())):
        if metadata.get(key) and metadata[key] != here:
            found.append(f"{key} {metadata[key]!r} vs {here!r}")
    isa = metadata.get("AOTI_CPU_ISA") or ""
    lacking = [w for w in isa.split() if w in _CPU_FEATURES and not getattr(torch.cpu, _CPU_FEATURES[w])()]
    if lacking:
        found.append(f"AOTI_CPU_ISA {isa!r} needs {lacking}, which this CPU lacks")
    built = metadata.get("AOTI_COMPUTE_CAPABILITY")
    if built and device.type == "cuda" and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        if built != str(major * 10 + minor):
            found.append(f"AOTI_COMPUTE_CAPABILITY {built!r} vs {str(major * 10 + minor)!r}")
    return found


def _archive_weights(path: str, names: tuple[str, ...], device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """Per program, its constants stored inside the archive (``--weights inside``), each stored
    tensor read once and viewed by every program that uses it; empty when there are none."""
    reader = torch._C.PyTorchFileReader(path)  # the reader torch's own PT2ArchiveReader uses
    records = reader.get_all_records()
    maps = {}
    for name in names:
        prefix = f"data/aotinductor/{name}/"
        config = [r for r in records if r.startswith(prefix) and r.endswith(_WEIGHTS_CONFIG_SUFFIX)]
        if config:
            maps[name] = json.loads(reader.get_record(config[0]).decode())
    stored: dict[str, torch.Tensor] = {}
    constants = {}
    for name, weight_map in maps.items():
        constants[name] = {}
        for fqn, (file, shape, stride, offset) in weight_map.items():
            if file not in stored:
                data = reader.get_record(_WEIGHTS_DIR + file)
                stored[file] = torch.load(io.BytesIO(data), map_location=device)
            constants[name][fqn] = stored[file].as_strided(shape, stride, offset)
    return constants


def load_aoti_programs(path: str, names: tuple[str, ...], device: torch.device, *,
                       single_threaded: tuple[str, ...] = ()) -> dict[str, PackagedProgram]:
    """``{name: program}`` for the named AOTInductor programs of the ``.pt2`` at ``path``, on
    ``device``; constants stored inside the archive are loaded into them, external ones are the
    caller's to load. The programs named in ``single_threaded`` are loaded with AOTInductor's
    ``run_single_threaded``: their default run records a completion event and queries it on the next
    call, which a CUDA graph capture refuses ("operation not permitted when stream is capturing")."""
    index = device.index if device.index is not None else -1
    programs = {}
    for name in names:
        # (path, model name, run_single_threaded, num_runners, device index): load_pt2's defaults
        loader = torch._C._aoti.AOTIModelPackageLoader(path, name, name in single_threaded, 1, index)
        programs[name] = PackagedProgram(name, loader)
        for mismatch in host_mismatches(programs[name].get_metadata(), device):
            logger.warning("tscompile: program %r of %s was compiled on another kind of host (%s); it may not run "
                           "here", name, path, mismatch)
    for name, constants in _archive_weights(path, names, device).items():
        programs[name].load_constants(constants, check_full_update=True, user_managed=True)
    return programs
