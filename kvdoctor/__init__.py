"""kvdoctor: why a vLLM GPU is out of memory (or idle), and which exact flag fixes it."""

__version__ = "0.1.0"
