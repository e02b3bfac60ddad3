"""The syscall channel protocol as data (PROTOCOL.md and its companions, schema/, vectors/, examples/) and its
conformance runner.

`spec.conformance` is the `syscall-conformance` console script: it certifies a kernel or a client of any
implementation against the vectors and the behavioural MUSTs (what conforming means: PROTOCOL.md section 14;
the suite: CONFORMANCE.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

# The protocol files, shipped as package data so an installed wheel carries them beside the runner.
SPEC_DIR: Final = Path(__file__).resolve().parent
PROTOCOL_MD: Final = SPEC_DIR / "PROTOCOL.md"
# PROTOCOL.md is the core; these complete it (kernel behaviour, the reference tool, the conformance suite).
COMPANIONS: Final = (SPEC_DIR / "KERNEL.md", SPEC_DIR / "TOOL.md", SPEC_DIR / "CONFORMANCE.md")
EXAMPLE_DIR: Final = SPEC_DIR / "examples"
SCHEMA_DIR: Final = SPEC_DIR / "schema" / "v1"
VECTOR_DIR: Final = SPEC_DIR / "vectors" / "v1"
VECTOR_SCHEMA: Final = SPEC_DIR / "vectors" / "vector.schema.json"
