"""The `rlhf-orch` console command: `train`, `check` and `print-config` on an experiment YAML plus overrides.

    rlhf-orch train --config configs/tiny_cpu.yaml [section.key=value | ~section.key ...]
    rlhf-orch check --config configs/tiny_cpu.yaml [...]         # every pre-Ray check; resolved config; "ok"
    rlhf-orch print-config --config configs/tiny_cpu.yaml [...]  # the resolved config only

`train` is `python launch.py` (its `main`, the same arguments and exit codes); `check` runs launch.py's whole
pre-Ray stage (config, dataset rows, model folder, tokenizer, reward function, evaluation prompts, what this
machine can hold, the run folder) and stops before Ray. Bad input: one `error:` line per problem, exit code 2.

This module deliberately imports nothing heavy at its top (argparse and the config layer, which is pydantic and
yaml only, no torch): `rlhf-orch --help` answers in well under a second. torch, transformers and Ray come in only with the
subcommand that needs them, and launch.py (the driver, which imports Ray: this library must not) is loaded from
the checkout only by `train` and `check`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlhf_orch.config import load_config
from rlhf_orch.config.loader import config_yaml
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.errors import RLHFOrchError
from rlhf_orch.run_dir import claim_run_dir, job_output_override

ROOT = Path(__file__).resolve().parent.parent   # the checkout: launch.py, actors/, and reward modules like tests.*

OVERRIDES_HELP = ("overrides, as Hydra writes them: section.key=value sets a field (engines.0.count=2 indexes a "
                  "list; a bare item for a list field is a list of one: metrics.trackers=wandb), ~section.key "
                  "removes a key of the config file (e.g. ~data.max_operand)")


def add_run_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--config and the overrides: the arguments of launch.py and of every subcommand here."""
    p.add_argument("--config", required=True, help="experiment YAML, e.g. configs/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="override", help=OVERRIDES_HELP)
    return p


def sections_help() -> str:
    """The config's sections with their one-line descriptions (for --help)."""
    fields = ExperimentConfig.model_fields
    width = max(len(name) for name in fields) + 2
    lines = ["config sections (configs/*.yaml; every field has a default and a description in "
             "rlhf_orch/config/schema.py):"]
    for name, field in fields.items():
        lines.append(f"  {name:<{width}}{(field.description or '').splitlines()[0] if field.description else ''}")
    return "\n".join(lines)


def run_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """launch.py's parser: --config, overrides, and the sections in its --help."""
    p = argparse.ArgumentParser(prog=prog, description="RL post-training with Ray, DeepSpeed and vLLM/SGLang/HF engines.",
                                epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_run_arguments(p)


def parse_run_args(argv, prog: str | None = None) -> argparse.Namespace:
    # intermixed: `--config X a=1` and `a=1 --config X b=2` both work (plain parse_args drops the second group)
    return run_parser(prog).parse_intermixed_args(argv)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (its --help) and one parser per subcommand."""
    p = argparse.ArgumentParser(
        prog="rlhf-orch", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="RL post-training with Ray, DeepSpeed and vLLM/SGLang/HF engines.",
        epilog=sections_help() + "\n\nexamples:\n"
        "  rlhf-orch check --config configs/tiny_cpu.yaml data.source=my.jsonl ~data.max_operand\n"
        "  rlhf-orch train --config configs/tiny_cpu.yaml experiment.steps=100 metrics.trackers=wandb\n"
        "  rlhf-orch print-config --config configs/tiny_cpu.yaml trainer.lr=1e-4")
    sub = p.add_subparsers(dest="command", required=True, metavar="{train,check,print-config}")
    subs = {}
    for name, what in (("train", "run the experiment (what `python launch.py` does)"),
                       ("check", "run every check launch.py makes before Ray starts, without starting Ray; print "
                                 "the resolved config and 'ok'"),
                       ("print-config", "print the resolved config (every field that applies, defaults included) "
                                        "as YAML that --config reads back")):
        subs[name] = add_run_arguments(sub.add_parser(name, help=what, description=what, epilog=sections_help(),
                                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    return p, subs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top, subs = build_parser()
    if not argv or argv[0] not in subs:
        top.parse_args(argv)   # --help, or a usage error naming the subcommands (both exit)
        return 2
    # Each subcommand's own parser, intermixed (`--config` before or after the overrides): argparse cannot
    # parse intermixed arguments through subparsers.
    args = subs[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    if str(ROOT) not in sys.path:
        # The sys.path `python launch.py` has (its folder first): reward functions such as tests.ppo_rewards:... import
        # in the driver as they do in the workers, which get the checkout on PYTHONPATH (driver/cluster.py).
        sys.path.insert(0, str(ROOT))
    run_argv = ["--config", args.config, *args.overrides]
    if args.command == "train":
        return _launch().main(run_argv)
    _log_to_stderr()
    try:
        if args.command == "check":
            cfg, run_dir = _check(run_argv)
        else:
            cfg, run_dir = _load(args.config, args.overrides), None
    except RLHFOrchError as e:
        for line in str(e).splitlines():
            sys.stderr.write(f"error: {line}\n")
        return 2
    sys.stdout.write(config_yaml(cfg))
    if run_dir is not None:
        sys.stdout.write(f"ok: every check before Ray passed; the run would write to {run_dir.resolve()}\n")
    sys.stdout.flush()
    return 0


def _load(config: str, overrides: list[str]):
    """load_config as launch.py calls it (in a Ray job, with its output folder moved out of the working dir)."""
    extra, _ = job_output_override(config, overrides, dict(os.environ), os.getcwd())
    return load_config(config, [*overrides, extra] if extra else overrides)


def _check(run_argv: list[str]):
    """launch.py's pre-Ray stage (launch.preflight), then the run-folder check main() makes under its lock, in the
    cases where it deletes nothing. Returns (config, run folder); raises RLHFOrchError."""
    launch = _launch()
    cfg, run_dir, *_ = launch.preflight(run_argv)
    if cfg.resume or not cfg.experiment.overwrite:   # resume=false + overwrite=true would delete the earlier outputs
        claim_run_dir(run_dir, cfg.resume, cfg.experiment.overwrite)
    return cfg, run_dir


def _launch():
    """launch.py of this checkout, imported on demand: it is the driver (it brings Ray, transformers and torch in with
    the run) and lives beside the package rather than in it, so the library never imports it at load time."""
    mod = sys.modules.get("launch")
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == ROOT / "launch.py":
        return mod   # already imported (tests, `python -c`): one module, one set of signal-handler state
    path = ROOT / "launch.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: `rlhf-orch train` and `check` run launch.py from the rlhf_orch "
                         "checkout; install it with `pip install -e .` from a clone")
    import importlib.util
    spec = importlib.util.spec_from_file_location("launch", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch"] = mod
    spec.loader.exec_module(mod)
    return mod


def _log_to_stderr() -> None:
    # The YAML goes to stdout (pipe it to a file); the library's log lines to stderr, warnings and up unless asked.
    import logging
    logging.basicConfig(level=os.environ.get("RLHF_ORCH_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
