"""yeto_proto is what third parties import alone: it must not pull in torch or anyio."""

from __future__ import annotations

import subprocess
import sys


def test_importing_yeto_proto_loads_neither_torch_nor_anyio() -> None:
    probe = (
        "import sys, yeto_proto, yeto_proto.checkpoint, yeto_proto.dtypes; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'anyio'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_yeto_proto_ships_its_type_marker() -> None:
    import importlib.resources

    assert importlib.resources.files("yeto_proto").joinpath("py.typed").is_file()
