"""Write docs/config.md, the reference of every config key, from the schema.

python scripts/config_reference.py          # rewrite docs/config.md
python scripts/config_reference.py --check  # exit 1 when docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_learner.config.reference import config_reference, render_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = render_markdown(config_reference())
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
