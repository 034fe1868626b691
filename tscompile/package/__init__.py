"""Model packages: ``tscompile export`` writes one ``.pt2``; ``tscompile.load_package`` runs it.

A package holds two AOTInductor programs built with ``torch.export`` from one model, ``prefill``
(extend and mixed steps) and ``decode`` (``programs.py``), plus a metadata record (``record.py``).
The custom ops stay in the graphs: AOTInductor calls them through its proxy executor, so importing
tscompile (which registers them) is what a loaded package needs. ``build.py`` exports and packages;
``runtime.py`` loads and runs a package behind ``tscompile.LLM``'s ``generate``.

``--weights inside`` stores every weight once in the archive, shared by both programs;
``--weights external`` writes them beside the package (``<name>.safetensors``) and the loaded
programs borrow the tensors read from it (``user_managed`` constants), so no second copy exists.
"""

from tscompile.package.build import check_exportable_backend, export_package
from tscompile.package.programs import PROGRAMS, DecodeProgram, PrefillProgram, export_programs, program_ops
from tscompile.package.record import FORMAT_VERSION, check_compatible, read_package_metadata, weights_path
from tscompile.package.runtime import PackageInfo, PackageRunner, load_package

__all__ = [
    "FORMAT_VERSION", "PROGRAMS", "DecodeProgram", "PackageInfo", "PackageRunner", "PrefillProgram", "check_compatible",
    "check_exportable_backend",
    "export_package", "export_programs", "load_package", "program_ops", "read_package_metadata", "weights_path",
]
