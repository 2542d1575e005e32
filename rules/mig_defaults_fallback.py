"""## What
The engine runs on a GPU in MIG mode (or NVML answers NoPermission for the parent device) and
`--max-num-seqs` / `--max-num-batched-tokens` were not set explicitly.

## Why
Since 0.10 vLLM chooses both defaults from the device's memory and name (1024 / 8192-16384 on
≥ 70 GiB H100-class cards, 256 / 2048 otherwise; vllm-facts §4.2). On a MIG instance, or when
NVML answers NoPermission, it reads the memory as 0 and falls back to the smallest tier
(256 seqs / 2048 batched tokens for the server) whatever the slice or card really holds. The
fix is the tier vLLM would pick for the real memory — never the values already in effect — and
larger when every step sits at the cap while requests wait and the KV cache is not full.

## How to confirm
`nvidia-smi` shows `MIG M.: Enabled` and a "MIG devices" table; the engine's log shows
`max_num_batched_tokens` larger than the slice would warrant.

## Fix
Set `--max-num-seqs` and `--max-num-batched-tokens` explicitly to the tier of the memory the
slice or card really has (1024 / 8192 on ≥ 70 GiB H100-class memory, 256 / 2048 below), never
to the values in effect; double them when every step sits at the cap while requests wait and
the KV cache is not full. The slice's memory comes from what CUDA reports inside it (the OOM
message, the post-warm-up summary), not from the parent card's nvidia-smi total.

## Sources
spec/rules.md family P; vllm-facts.md §4.2 (device-dependent defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.findings import Severity
from kvdoctor.rulekit import Evidence, Facts, Fix, Hit, Rule, gib_text, is_valid, na
from kvdoctor.vllm_flags import default_max_num_batched_tokens, default_max_num_seqs

#: vLLM's small-device tier (the server's), what it falls back to when it reads 0 memory
_SMALL_SEQS, _SMALL_MNBT = 256, 2048


@dataclass(frozen=True)
class Thresholds:
    #: KV cache usage below which a step at the cap with requests waiting is held back by the limits
    kv_full: float = 0.9


def _new_value(explicit: bool | None, tier: int | None, now: int, at_cap: bool) -> int | None:
    """The value to set (None: it was set explicitly, or nothing can be sized): the tier for the
    real memory, at least double the one in effect when the engine sits at the cap; None when
    that is the value in effect."""
    if explicit or not (tier or at_cap):
        return None
    value = max(tier or 0, 2 * now) if at_cap else tier
    return value if value != now else None


def check(f: Facts, t: Thresholds) -> Hit | None:
    seqs_explicit, mnbt_explicit = f["max_num_seqs_explicit"], f["max_num_batched_tokens_explicit"]
    if not (f["gpu_mig"] or f["gpu_no_permission"]) or (seqs_explicit and mnbt_explicit):
        return None
    # In effect: what was set or logged, else vLLM's small tier (vllm-facts §4.2).
    seqs_now = f["max_num_seqs"] or _SMALL_SEQS
    mnbt_now = f["max_num_batched_tokens"] or _SMALL_MNBT
    # The tier vLLM would pick for the memory the slice or card really has.
    usable, version, name = f["usable_device_bytes"], f["vllm_version"], f["gpu_name"]
    seqs_tier = default_max_num_seqs(version, usable, name) if usable else None
    mnbt_tier = default_max_num_batched_tokens(version, usable, name) if usable else None
    # Every step at the cap while requests wait and the KV is not full: the limits hold it back.
    running, waiting, kv = f["running"], f["waiting_max"], f["kv_usage_max"]
    at_cap = bool(
        running is not None
        and running >= seqs_now
        and (waiting or 0) > 0
        and kv is not None
        and kv < t.kv_full
    )
    flags: dict[str, str] = {}
    seqs_fix = _new_value(seqs_explicit, seqs_tier, seqs_now, at_cap)
    if seqs_fix is not None and is_valid(f, "--max-num-seqs", seqs_fix):
        flags["--max-num-seqs"] = str(seqs_fix)
    mnbt_fix = _new_value(mnbt_explicit, mnbt_tier, mnbt_now, at_cap)
    if mnbt_fix is not None and is_valid(f, "--max-num-batched-tokens", mnbt_fix):
        flags["--max-num-batched-tokens"] = str(mnbt_fix)

    gpu_name = f" ({name})" if name else ""
    if f["gpu_mig"]:
        cause = (
            f"The engine's GPU is in MIG mode{gpu_name}: vLLM picks max_num_seqs and max_num_batched_tokens"
            " from the memory NVML reports, and on a MIG instance it falls back to its small-device tier"
            " whatever the slice holds."
        )
    else:
        cause = (
            "The driver refuses to read the memory of the engine's GPU (NVML NoPermission, nvidia-smi"
            " [Insufficient Permissions]): vLLM then takes the device memory as 0 and falls back to its"
            " small-device limits, far below what the card holds."
        )
    seqs_from = " (logged)" if f["max_num_seqs"] else " (vLLM's small tier)"
    mnbt_from = " (logged)" if f["max_num_batched_tokens"] else " (vLLM's small tier)"
    in_effect = (
        f"In effect: max_num_seqs {seqs_now}{seqs_from}, max_num_batched_tokens {mnbt_now}{mnbt_from}."
    )
    fixes: list[Fix] = []
    if flags:
        memory = f"for the {gib_text(usable, '.0f')} GiB really available" if usable else "higher"
        cap = (
            " - every step sits at the cap while requests wait and the KV cache is not full" if at_cap else ""
        )
        advice = f"Set them {memory}{cap}: " + " ".join(f"{k} {v}" for k, v in flags.items()) + "."
        why = (
            "room above the cap the engine sits at"
            if at_cap
            else "the tier vLLM picks for the memory really there"
        )
        fixes.append(Fix(flags=flags, why=why))
    elif seqs_fix is not None or mnbt_fix is not None:
        advice = (
            "The values sized for the memory really available are not ones this engine can take; set"
            " max_num_seqs and max_num_batched_tokens explicitly for it."
        )
    elif usable:
        advice = (
            f"The tier vLLM would pick for the {gib_text(usable, '.0f')} GiB really available is the same, so"
            " nothing to change; set them explicitly to keep it so."
        )
    else:
        advice = (
            "The memory really available is unknown here, so no values can be sized; set max_num_seqs and"
            " max_num_batched_tokens explicitly for the slice."
        )

    gpus = f["engine_gpus"]
    evidence: list[Evidence] = []
    if f["gpu_mig"]:
        evidence.append(
            Evidence(
                "MIG mode",
                f"enabled on GPU {na(gpus)}",
                "nvidia-smi MIG M. column / NVML nvmlDeviceGetMigMode / MIG-… UUID in CUDA_VISIBLE_DEVICES",
            )
        )
    if f["gpu_no_permission"]:
        evidence.append(
            Evidence(
                "device memory",
                f"NoPermission on GPU {na(gpus)}",
                "nvidia-smi [Insufficient Permissions] / NVML NVMLError_NoPermission",
            )
        )
    evidence.append(
        Evidence(
            "--max-num-seqs / --max-num-batched-tokens",
            f"{'set' if seqs_explicit else 'not set'} / {'set' if mnbt_explicit else 'not set'}",
            "launch command",
        )
    )
    if at_cap:
        evidence.append(
            Evidence(
                "engine at its step cap",
                f"{na(running, '.0f')} running, {na(waiting, '.0f')} waiting, KV {na(kv, '.0%')}",
                "vllm:num_requests_running / waiting / kv_cache_usage_perc",
            )
        )
    # Nothing to change when the small tier is also the one the real memory calls for.
    severity: Severity | None = "info" if seqs_fix is None and mnbt_fix is None else None
    return Hit(
        summary=f"{cause} {in_effect} {advice}",
        evidence=evidence,
        fixes=fixes,
        gpus=sorted(set(gpus or ())),
        severity=severity,
    )


RULE = Rule(
    id="mig-defaults-fallback",
    family="P",
    severity="warning",
    title="vLLM runs on a MIG slice or an unreadable device with its small-device batch limits",
    doc=__doc__,
    thresholds=Thresholds(),
    check=check,
    needs=("gpus",),
    flags=("--max-num-seqs", "--max-num-batched-tokens"),
)
