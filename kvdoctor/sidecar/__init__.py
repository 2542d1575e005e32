"""The sidecar face: ``kvdoctor sidecar`` serves kvdoctor's findings as Prometheus metrics.

``server`` (the loop thread and the HTTP endpoints), ``exposition`` (the /metrics series),
``transitions`` (for: / clear_for: hysteresis and the JSON-lines log), ``command`` (click).
"""
