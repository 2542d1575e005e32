"""Regenerate deploy/prometheus/kvdoctor-alerts.yaml from the rule catalogue (kvdoctor.rules).

python deploy/generate.py          # rewrite the file
python deploy/generate.py --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvdoctor.sidecar.alerts import shipped_rules_text

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "deploy" / "prometheus" / "kvdoctor-alerts.yaml"


def main() -> int:
    text = shipped_rules_text()
    if "--check" in sys.argv[1:]:
        if not TARGET.is_file() or TARGET.read_text() != text:
            print(
                f"{TARGET.relative_to(ROOT)} is out of date: run python deploy/generate.py", file=sys.stderr
            )
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
