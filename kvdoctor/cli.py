"""The ``kvdoctor`` command line.

Each subcommand lives in its own module and is imported only when it runs, so ``kvdoctor --help``
stays fast (bench/startup.py measures it) and ``diagnose`` never imports Textual.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

import click

#: young-generation threshold of the garbage collector in a kvdoctor process (Python's: 700)
GC_THRESHOLD0 = 50_000

# name -> (module:attribute of the click command, one-line help shown by ``kvdoctor --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "diagnose": (
        "kvdoctor.diagnose:diagnose_command",
        "Find why a vLLM GPU is out of memory or idle, with the flag that fixes it.",
    ),
    "plan": (
        "kvdoctor.plan:plan_command",
        "Plan KV-cache capacity for a model, GPU and vLLM flags (agrees with vLLM to the block).",
    ),
    "record": (
        "kvdoctor.commands.record:record_command",
        "Record Snapshots of the inputs to a JSONL file (.gz/.zst) for replay.",
    ),
    "bundle": (
        "kvdoctor.commands.bundle:bundle_command",
        "Write a redacted support bundle (directory or .tar.gz) from the current inputs.",
    ),
    "watch": (
        "kvdoctor.watch.command:watch_command",
        "Live TUI: each GPU's memory by what holds it, engines, findings with their fix (--demo to try).",
    ),
    "sidecar": (
        "kvdoctor.sidecar.command:sidecar_command",
        "Serve findings as Prometheus metrics next to a vLLM server (/metrics, /readyz, /findings).",
    ),
    "rules": ("kvdoctor.rules_cli:rules_command", "List the rule catalogue."),
    "explain": ("kvdoctor.rules_cli:explain_command", "Show one rule's documentation."),
}


def silence_stdout() -> None:
    """Point stdout at /dev/null after a reader went away (``| head``), so the interpreter's
    final flush raises no second BrokenPipeError and the exit code stays the one chosen."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Command names, in the order of COMMANDS."""
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import the command's module now that it is needed; None for an unknown name."""
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target[0].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List commands with their one-line help from COMMANDS."""
        # Short help from the table above: listing commands imports none of them.
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvdoctor")
def cli() -> None:
    """kvdoctor: why is this vLLM GPU out of memory (or idle), and which exact flag fixes it?

    Reads nvidia-smi / NVML, vLLM's /metrics and log, the launch command and the model's
    config.json, live or from a support bundle, and prints findings with computed fixes.
    """


def main() -> None:
    """Console-script entry point. Exit codes (spec/report.md): 0 ok, 1 warning, 2 critical,
    3 unknown — including a command-line error, so a typo in a probe never pages as CRITICAL
    (click's own convention would be 2)."""
    # A start allocates ~10^5 objects that live as long as the process (modules, classes, the
    # compiled rules) and almost no cyclic garbage: at Python's threshold of 700 the collector
    # runs ~60 times over them to find nothing, ~7 % of a cold `diagnose --bundle` (issue 8,
    # class 10). Long-running faces (watch, sidecar) still collect, every 50,000 allocations;
    # refcounting frees all other garbage at once. Only the console entry point sets it: a
    # process that imports kvdoctor (vLLM with the stat-logger plugin, tests) keeps its own.
    gc.set_threshold(GC_THRESHOLD0, *gc.get_threshold()[1:])
    _sigterm_unwinds()
    try:
        _run()
    finally:
        # The process ends now: the interpreter's last full collection would walk every object
        # the run made (~5 % of a cold diagnose) for garbage the exit frees anyway. Frozen,
        # they are left to the exit (stdout/stderr are still flushed, atexit handlers run).
        gc.freeze()


def _sigterm_unwinds() -> None:
    """SIGTERM unwinds every command like Ctrl-C does (SystemExit 143), so ``finally`` blocks
    and temporary directories (an archive's extracted copy with an unredacted env.txt, a bundle
    being written) are removed. Commands that stop gracefully on SIGTERM (record, sidecar)
    install their own handler while they run. A handler someone else installed is left alone."""
    import signal

    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):

            def _term(signum: int, _frame: object) -> None:
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, _term)
    except (ValueError, OSError, AttributeError):  # not the main thread, or no SIGTERM
        pass


def _run() -> None:
    try:
        rv = cli.main(prog_name="kvdoctor", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.UsageError as e:
        e.show()
        sys.exit(3)
    except click.ClickException as e:
        e.show()
        sys.exit(3)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader (``| head``) went away; nothing more to say.
        silence_stdout()
        sys.exit(0)
    except Exception as e:
        # The last guard: whatever escaped a command is one line and UNKNOWN (3), never a
        # traceback with exit 1 (WARNING to a probe). The message is the exception type only:
        # its text may quote the input.
        click.echo(f"kvdoctor: internal error ({_reason(e)}); nothing was diagnosed", err=True)
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'I/O error'}"
    return type(exc).__name__


if __name__ == "__main__":
    main()
