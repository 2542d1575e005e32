"""Checks of a vLLM + kvdoctor pod spec shared by the manifest's and the Helm chart's tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10**3, "M": 10**6, "G": 10**9}


def parse_quantity(value: str | int) -> int:
    """A Kubernetes byte quantity (``256Mi``, ``1G``, ``201326592``) in bytes."""
    m = re.fullmatch(r"(\d+)([KMG]i?|k)?", str(value))
    assert m, f"not a byte quantity: {value!r}"
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def assert_safe_vllm_pod(pod: dict[str, Any]) -> None:
    """The pod spec runs vLLM with the kvdoctor sidecar safely:

    - the sidecar is a native sidecar (init container, restartPolicy: Always) with no
      readinessProbe and no startupProbe: Kubernetes counts a native sidecar's readiness in the
      Pod's Ready condition, and a startupProbe holds vLLM's start; no container but vLLM has a
      readinessProbe, and vLLM's own probe is on vLLM's port;
    - the sidecar takes no GPU, runs read-only, non-root, without privilege escalation, limited,
      and knows its pod (POD_NAMESPACE/POD_NAME from the downward API);
    - vLLM runs non-root with USER (torch's getpass.getuser() never reaches getpwuid()), a
      writable HOME and its caches on a writable volume;
    - the log vLLM writes is the one the sidecar follows, through a volume both mount.
    """
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (side,) = [c for c in pod.get("initContainers", []) if c["name"] == "kvdoctor"]
    assert side["restartPolicy"] == "Always"  # a native sidecar
    for c in pod.get("initContainers", []) + pod["containers"]:
        if c["name"] == "vllm":
            continue
        for probe in ("readinessProbe", "startupProbe"):
            assert probe not in c, f"{c['name']}: a {probe} on a sidecar would gate vLLM"
    assert side["args"][0] == "sidecar" and any(a.startswith("--listen=0.0.0.0:") for a in side["args"])
    sec = side["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False
    assert side["resources"]["limits"]["memory"] and side["resources"]["limits"]["cpu"]
    assert "nvidia.com/gpu" not in str(side["resources"])  # it must not take a GPU of its own
    downward = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in side["env"]}
    assert downward["POD_NAMESPACE"] == "metadata.namespace" and downward["POD_NAME"] == "metadata.name"

    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    side_port = str(side["ports"][0]["containerPort"])
    assert "readinessProbe" in vllm and side_port not in str(vllm["readinessProbe"])
    assert vllm["readinessProbe"]["httpGet"]["port"] in ("http", vllm["ports"][0]["containerPort"])
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env.get("USER") or env.get("LOGNAME"), "getpass.getuser() would call getpwuid()"
    mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    for var in ("HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = Path(env[var])
        assert any(path.is_relative_to(m) and not v.get("readOnly") for m, v in mounts.items()), var

    (log_arg,) = [a for a in side["args"] if a.startswith("--log=")]
    log_path = Path(log_arg.split("=", 1)[1])
    assert str(log_path.parent) in vllm["args"][0] and log_path.name in vllm["args"][0]

    def mount(c: dict[str, Any], path: Path) -> dict[str, Any]:
        return next(m for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"]))

    side_mount, vllm_mount = mount(side, log_path), mount(vllm, log_path)
    assert side_mount["name"] == vllm_mount["name"] and side_mount.get("readOnly") is True
    assert any(v["name"] == side_mount["name"] for v in pod["volumes"])
