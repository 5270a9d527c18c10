"""Stub TransformerEngine's grouped-activation kernels (``activation/*_grouped*.cu``) for a slim Hopper build.

    python tools/te_slim.py TE_SOURCE/transformer_engine/common/activation

Each ``void nvte_*(...)`` defined in those files keeps its signature and raises ``NVTE_ERROR`` naming itself.
These take ``NVTEGroupedTensor`` (Blackwell's fused grouped MLP); TE's PyTorch extension calls none of them.
"""

import pathlib
import re
import sys

DEFINITION = re.compile(r"^void (nvte_\w+)\(([^)]*)\)\s*\{", re.M)


def stub(text: str) -> str:
    """``text`` with every ``nvte_*`` definition's body replaced by an ``NVTE_ERROR``."""
    out = ["#include <transformer_engine/activation.h>\n\n#include \"../util/logging.h\"\n"]
    for match in DEFINITION.finditer(text):
        name, params = match.groups()
        out.append(f"\nvoid {name}({params}) {{\n  NVTE_ERROR(\"{name}: not built (slim TransformerEngine "
                   f"build for Hopper, tools/build_te.sh)\");\n}}\n")
    if len(out) == 1:
        raise ValueError("no nvte_* definition found")
    return "".join(out)


def main(folder: str) -> None:
    files = sorted(pathlib.Path(folder).glob("*_grouped*.cu"))
    if not files:
        raise SystemExit(f"no *_grouped*.cu under {folder}")
    for path in files:
        path.write_text(stub(path.read_text()))
        print(f"stubbed {path.name}")


if __name__ == "__main__":
    main(sys.argv[1])
