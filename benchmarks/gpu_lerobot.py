"""Run ``lerobot.py`` (beside this file) where PyAV is missing, for ``benchmarks/gpu.sh``.

``lerobot.py --part parquet`` needs no PyAV, but its ``machine_info()`` reads
``av.__version__``; this runs its ``main()`` unchanged with ``machine_info()`` wrapped so
that, PyAV missing, the record reads ``"av": "missing"`` (a placeholder module stands in
for ``av`` during that one call only, so nothing else can mistake it for PyAV).

    python benchmarks/gpu_lerobot.py --part parquet [lerobot.py's other options]

``gpu.sh`` runs it from a copy of ``benchmarks/`` in a temporary folder, so that
``lerobot.py``'s fixed ``results/lerobot.json`` lands there and the checkout's is left
alone.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def main() -> None:
    path = Path(__file__).parent / "lerobot.py"
    spec = importlib.util.spec_from_file_location("lerobot", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lerobot"] = mod
    spec.loader.exec_module(mod)
    original = mod.machine_info

    def machine_info():
        if importlib.util.find_spec("av") is not None:
            return original()
        placeholder = types.ModuleType("av")
        placeholder.__version__ = "missing"
        sys.modules["av"] = placeholder
        try:
            return original()
        finally:
            del sys.modules["av"]

    mod.machine_info = machine_info
    sys.argv = [str(path), *sys.argv[1:]]
    mod.main()


if __name__ == "__main__":
    main()
