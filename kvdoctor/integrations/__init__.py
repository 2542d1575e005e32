"""Integrations that run kvdoctor inside other programs (``vllm``: the in-process stat logger).

Nothing here is imported by the base install; each integration imports its host only when used.
"""
