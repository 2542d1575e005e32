"""Regenerate what deploy/ and docs/runbooks/ derive from the rule catalogue.

- deploy/prometheus/kvdoctor-alerts.yaml (kvdoctor.sidecar.alerts over `kvdoctor rules --format json`)
- deploy/helm/kvdoctor/files/kvdoctor-alerts.yaml (the same text: the chart's PrometheusRule)
- deploy/helm/kvdoctor/files/kvdoctor-dashboard.json (deploy/dashboard.py, grafana-foundation-sdk)
- docs/runbooks/ID.md per rule and docs/runbooks/README.md (kvdoctor.sidecar.runbooks, from
  `kvdoctor explain ID`)

python deploy/generate.py          # rewrite them
python deploy/generate.py --check  # exit 1 when one is out of date (CI, tests/sidecar/test_deploy.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvdoctor.sidecar.alerts import catalogue, render_alert_rules
from kvdoctor.sidecar.runbooks import runbook_pages

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
TARGET = ROOT / "deploy" / "prometheus" / "kvdoctor-alerts.yaml"
CHART_FILES = ROOT / "deploy" / "helm" / "kvdoctor" / "files"
RUNBOOKS = ROOT / "docs" / "runbooks"


def expected() -> dict[Path, str]:
    """Every generated file and its text."""
    rules = catalogue()
    alerts = render_alert_rules(rules)
    out = {TARGET: alerts, CHART_FILES / "kvdoctor-alerts.yaml": alerts}
    try:
        from dashboard import dashboard_json  # deploy/dashboard.py
    except ImportError:  # grafana-foundation-sdk (the [deploy] extra) not installed
        print(
            "grafana-foundation-sdk not installed (pip install -e '.[deploy]'): the dashboard is not "
            "generated or checked",
            file=sys.stderr,
        )
    else:
        out[CHART_FILES / "kvdoctor-dashboard.json"] = dashboard_json()
    for name, text in runbook_pages(rules).items():
        out[RUNBOOKS / name] = text
    return out


def main() -> int:
    files = expected()
    stale = sorted(p for p, text in files.items() if not p.is_file() or p.read_text() != text)
    extra = sorted(set(RUNBOOKS.glob("*.md")) - set(files)) if RUNBOOKS.is_dir() else []
    if "--check" in sys.argv[1:]:
        for p in stale + extra:
            print(f"{p.relative_to(ROOT)} is out of date: run python deploy/generate.py", file=sys.stderr)
        return 1 if stale or extra else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p])
        print(f"wrote {p.relative_to(ROOT)}")
    for p in extra:  # the page of a rule that is gone
        p.unlink()
        print(f"removed {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
