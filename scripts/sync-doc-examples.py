#!/usr/bin/env python3
"""Copies example files into the docs that show them: every code block
preceded by a `<!-- file: PATH -->` marker in docs/*.md is replaced by the
file at PATH (relative to the repository root). `cargo test -p cxlkv-ffi
--test docs` fails when a block and its file differ.

usage: scripts/sync-doc-examples.py [DOC ...]   (default: every docs/*.md)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKED = re.compile(r"(<!-- file: (?P<path>\S+) -->\n```[^\n]*\n)(?P<body>.*?)(^```$)", re.M | re.S)


def sync(doc: Path) -> bool:
    text = doc.read_text()

    def fill(m: re.Match) -> str:
        body = (ROOT / m.group("path")).read_text()
        return m.group(1) + body + m.group(4)

    new = MARKED.sub(fill, text)
    if new != text:
        doc.write_text(new)
        return True
    return False


def main() -> int:
    docs = [Path(a) for a in sys.argv[1:]] or sorted((ROOT / "docs").glob("*.md"))
    for doc in docs:
        if sync(doc):
            print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
