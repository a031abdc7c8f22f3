"""The ``pyfedkern`` command line: run, compare, partition, reproduce, bench and info.

Algorithm hyper-parameters are the fields of each algorithm class and are passed as ``--name value`` after the
common options (e.g. ``pyfedkern run --algorithm fedprox --mu 0.1``); ``pyfedkern run --algorithm X --help-algorithm``
lists them.

Parsing, ``--help``, ``--version`` and usage errors import no torch (tests/test_cli.py checks it): each command
imports what it needs when it runs, and an algorithm's module is imported only when its parameters are needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import os
import shlex
import sys
import textwrap
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pyfedkern import __version__
from pyfedkern.benchmarks import FAMILIES
from pyfedkern.data.spec import parse_flag
from pyfedkern.reproduce import REPRODUCTIONS, SUMMARIES
from pyfedkern.sim import config as sim_config
from pyfedkern.sim.config import LAUNCHED_BY_WORKERS, OPTIONS, ExperimentConfig, Option


def _flag(text: str) -> bool:
    """A command-line boolean: true/false, yes/no, on/off or 1/0."""
    value = parse_flag(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _flag_or_auto(text: str) -> bool | None:
    """A command-line boolean, or None for "auto" (the program decides)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _flag(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}") from None


#: The config options that `run` and `compare` take as ``--name VALUE`` (the others have their own rules).
_COMMON = [o for o in OPTIONS.values() if o.parsed]


class CliError(Exception):
    """A usage error reported as `error: ...` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _add_option(parser: argparse.ArgumentParser, option: Option, help_text: str | None = None) -> None:
    """``--name VALUE`` for a config option, parsed by its kind (``help_text``: in place of the option's help)."""
    if option.kind == "bool":
        kind = _flag_or_auto if option.optional else _flag
    else:
        kind = {"int": int, "float": float, "str": str}[option.kind]
    help_text = f"{help_text or option.help} (default: {option.default})"
    parser.add_argument(option.flag, dest=option.name, type=kind, default=option.default, help=help_text)


def _add_common(parser: argparse.ArgumentParser) -> None:
    for option in _COMMON:
        _add_option(parser, option)
    parser.add_argument("--parity", action="store_true", help=OPTIONS["parity"].help)
    parser.add_argument(
        "--model-param", action="append", default=[], metavar="KEY=VALUE", help=OPTIONS["model_params"].help
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--log",
        type=_log_names,
        default=None,
        metavar="tensorboard|mlflow",
        help="also log the metrics to TensorBoard (tensorboard/ in the run directory) or MLflow (its mlflow.db), or "
        "both (tensorboard,mlflow); extras pyfedkern[tensorboard], pyfedkern[mlflow]",
    )


def _parse_value(text: str, example: Any) -> Any:
    """Convert a command-line string to the type of ``example`` (a field default)."""
    if isinstance(example, bool):
        value = parse_flag(text)
        if value is None:
            raise ValueError(f"expected true/false, got {text!r}")
        return value
    if isinstance(example, int):
        return int(text)
    if isinstance(example, float):
        return float(text)
    if isinstance(example, tuple):
        return tuple(_parse_value(p, example[0] if example else 0.0) for p in text.split(",") if p)
    if example is None:
        for convert in (int, float):
            try:
                return convert(text)
            except ValueError:
                pass
    return text


def _model_params(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--model-param expects KEY=VALUE, got {pair!r}")
        if "," in value:
            out[key] = tuple(_parse_value(v, None) for v in value.split(",") if v)
        else:
            out[key] = _parse_value(value, None)
    return out


def _split_extra(extra: Sequence[str]) -> dict[str, str | None]:
    """``['--mu', '0.1', '--alpha=0.5', '--beta']`` → ``{'mu': '0.1', 'alpha': '0.5', 'beta': None}``."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(extra):
        token = extra[i]
        if not token.startswith("--"):
            raise CliError(f"unexpected argument {token!r}")
        key, sep, value = token[2:].partition("=")
        if not sep:
            has_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
            value = extra[i + 1] if has_value else None
            i += has_value
        out[key.replace("-", "_")] = value
        i += 1
    return out


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]


def _did_you_mean(flag: str, options: Iterable[str]) -> str:
    """`` (did you mean --rounds?)`` for the option nearest to ``flag``, or an empty string when none is near."""
    near = difflib.get_close_matches(flag, list(options), n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


#: Similarity (difflib ratio) above which an unknown option is taken for a misspelled option of the command itself;
#: no algorithm parameter is that close to one (tests/test_cli.py checks), so none is ever refused by it.
TYPO_CUTOFF = 0.8


def _algorithm_params(
    algorithms: Sequence[str], extra: dict[str, str | None], options: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Assign each extra option to every selected algorithm that has a field of that name; an unknown option is
    reported with the nearest of the command's own ``options`` and the algorithms' parameters."""
    if not extra:
        return {name: {} for name in algorithms}
    from pyfedkern.algorithms import ALGORITHMS, algorithm_class

    fields = {name: algorithm_class(name).hyperparameters() for name in algorithms}
    params: dict[str, dict[str, Any]] = {name: {} for name in algorithms}
    for key, text in extra.items():
        flag = f"--{key.replace('_', '-')}"
        takers = [name for name in algorithms if key in fields[name]]
        if not takers:
            valid = sorted({f"--{k.replace('_', '-')}" for fs in fields.values() for k in fs})
            owners = [name for name in ALGORITHMS if key in algorithm_class(name).hyperparameters()]
            hint = f" (a parameter of {', '.join(owners)})" if owners else _did_you_mean(flag, [*options, *valid])
            raise CliError(
                f"unknown option {flag}{hint}; parameters of {', '.join(algorithms)}: {', '.join(valid) or 'none'}"
            )
        if text is None:
            raise CliError(f"option {flag} needs a value")
        for name in takers:
            field = fields[name][key]
            example = field.default if field.default is not dataclasses.MISSING else None
            try:
                params[name][key] = _parse_value(text, example)
            except ValueError as exc:
                raise CliError(f"--{key.replace('_', '-')}: {exc}") from None
    return params


def near_miss(flag: str, options: Sequence[str]) -> str | None:
    """The option of ``options`` that ``flag`` is a misspelling of (difflib ratio ≥ TYPO_CUTOFF between the names
    without their leading dashes, which would make short names look alike: ``--p`` and ``--dp``), or None."""
    bare = {option.lstrip("-"): option for option in options}
    near = difflib.get_close_matches(flag.lstrip("-"), list(bare), n=1, cutoff=TYPO_CUTOFF)
    return bare[near[0]] if near else None


def _refuse_typos(extra: Sequence[str], options: Sequence[str]) -> None:
    """CliError for an extra option that is a near miss of one of the command's own options (before anything heavy
    is imported: the algorithms' parameters are only looked up for the options that remain)."""
    for key in _split_extra(list(extra)):
        flag = f"--{key.replace('_', '-')}"
        near = near_miss(flag, options)
        if near:
            raise CliError(f"unknown option {flag} (did you mean {near}?)")


def _given_params(args: argparse.Namespace, extra: Sequence[str], algorithms: Sequence[str]) -> dict[str, dict]:
    """The algorithms' parameters given as the command's extra options (see :func:`_algorithm_params`)."""
    return _algorithm_params(algorithms, _split_extra(extra), _long_options(args.parser))


def _base_config(args: argparse.Namespace) -> ExperimentConfig:
    values = {o.name: getattr(args, o.name) for o in _COMMON}
    return ExperimentConfig(**values, parity=args.parity, model_params=_model_params(args.model_param))


def _resume_config(args: argparse.Namespace, extra: list[str]):
    """The config stored in --out, checked to agree with every option given on the command line besides it but
    --rounds (more rounds extend the run), --checkpoint-every and --data-root, which replace the stored values."""
    from pyfedkern.algorithms import make_algorithm
    from pyfedkern.sim.checkpoints import load_config
    from pyfedkern.sim.results import RESUME_FREE_FIELDS

    stored = load_config(args.out)
    asked = dataclasses.replace(_base_config(args), algorithm=args.algorithm)
    options = [(o.name, o.flag) for o in _COMMON]
    options += [("algorithm", "--algorithm"), ("parity", "--parity"), ("model_params", "--model-param")]
    free = {name: getattr(asked, name) for name, flag in options if name in RESUME_FREE_FIELDS and flag in args.flags}
    clashes = []
    for name, flag in options:
        value, have = getattr(asked, name), getattr(stored, name)
        if flag in args.flags and name not in free and _plain(value) != _plain(have):
            if flag == "--model-param":
                option = " ".join(f"{flag} {pair}" for pair in args.model_param)
            else:
                option = flag if flag == "--parity" else f"{flag} {_shown(value)}"
            clashes.append(f"{option} (the run has {name}={_shown(have)})")
    if asked.algorithm == stored.algorithm or "--algorithm" not in args.flags:
        algorithm = make_algorithm(stored.algorithm, **stored.algorithm_params)
        given = _given_params(args, extra, [stored.algorithm])[stored.algorithm]
        for key, value in given.items():
            have = getattr(algorithm, key)
            if _plain(value) != _plain(have):
                clashes.append(f"--{key.replace('_', '-')} {_shown(value)} (the run has {key}={_shown(have)})")
    elif extra:
        clashes.append(" ".join(extra))
    if clashes:
        raise CliError(
            f"--resume continues the run in {args.out} with the config stored there, and these options contradict "
            f"it: {', '.join(clashes)}; drop them, or start a new run in another --out directory"
        )
    return dataclasses.replace(stored, **free)


def _plain(value: Any) -> Any:
    """``value`` as config.json stores it (tuples become lists)."""
    return json.loads(json.dumps(value))


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(_plain(value))


def _help_algorithm(name: str) -> int:
    from pyfedkern.algorithms import algorithm_class

    cls = algorithm_class(name)
    print(f"{name}: {(cls.__doc__ or '').strip()}\n\nparameters:")
    for key, field in cls.hyperparameters().items():
        print(f"  --{key.replace('_', '-')} (default: {field.default})")
    return 0


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from pyfedkern.sim import distributed
    from pyfedkern.sim.checkpoints import check_resumable
    from pyfedkern.sim.engine import Simulation
    from pyfedkern.sim.results import check_new_run_dir

    _check_out(args.out)
    if args.help_algorithm:
        return _help_algorithm(args.algorithm)
    if args.log is not None and args.out is None:
        raise CliError("--log writes its logs in the run directory: give --out DIR")
    launched = sim_config.launched()  # by torchrun or by --workers: this process is one rank
    if launched and args.workers not in (None, sim_config.local_world_size()):
        raise CliError("--workers starts processes on this machine; under torchrun leave it out")
    workers = 1 if launched or args.workers is None else args.workers
    if args.resume:
        if args.out is None:
            raise CliError("--resume needs --out DIR (the run to continue)")
        config = _resume_config(args, extra)
        if not launched:  # (a launched run's rank 0 checks it, and tells the others)
            point = check_resumable(config, args.out, workers=workers)  # before the data is loaded
            print(_resuming(args.out, point, config.rounds))
    else:
        config = dataclasses.replace(
            _base_config(args),
            algorithm=args.algorithm,
            algorithm_params=_given_params(args, extra, [args.algorithm])[args.algorithm],
        )
        if args.out is not None and not launched:
            check_new_run_dir(args.out)  # before the data is loaded
    if args.workers is not None and not launched:
        distributed.check_workers(args.workers, config.device)
    if workers > 1:
        distributed.check_algorithm(config.algorithm, config.algorithm_params)
        try:
            return distributed.launch_workers(workers, args.argv)
        except distributed.ChildFailedWorkers as err:
            print(f"pyfedkern run: error: {err}{f'; {_left(args)}' if err.lost_work else ''}", file=sys.stderr)
            return err.status
    options = {"resume": args.resume, "progress": not args.no_progress, "callbacks": _loggers(args)}
    if launched:
        metrics = distributed.run_distributed(config, args.out, **options)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        metrics = Simulation(config).run(args.out, **options)
    last = next((m for m in reversed(metrics) if "test_acc" in m), metrics[-1])
    print(f"round {last['round']}: test accuracy {last['test_acc']:.4f}, test loss {last['test_loss']:.4f}")
    if args.out:
        print(f"results in {args.out}")
    return 0


def _log_names(text: str) -> str:
    """``--log``'s value, checked: logger names whose packages are installed (argparse's one-line error else)."""
    from pyfedkern.sim.loggers import check_loggers

    try:
        return check_loggers(text)
    except (ImportError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _loggers(args: argparse.Namespace) -> list:
    """The logger callbacks ``--log`` asks for (none without it)."""
    if args.log is None:
        return []
    from pyfedkern.sim.loggers import make_loggers

    return make_loggers(args.log)


def _resuming(out: str, point, rounds: int) -> str:
    """What a resume will do, from its :class:`~pyfedkern.sim.results.ResumePoint`."""
    if point.checkpoint is None:
        return f"resuming {out} from round 0 (it has no checkpoint yet): rounds 1..{rounds} to run"
    left = f"rounds {point.round + 1}..{rounds} to run" if point.round < rounds else "nothing left but its summary"
    return f"resuming {out} from round {point.round} (checkpoint {point.checkpoint.name}): {left}"


def _check_out(out: str | None) -> None:
    if out is not None and not out.strip():
        raise CliError(f"--out {out!r} names no directory; give a directory path (use --out . for this one)")


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from pyfedkern.sim.compare import compare

    _check_out(args.out)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    params = _given_params(args, extra, algorithms)
    result = compare(
        _base_config(args),
        algorithms,
        args.out,
        params=params,
        target=args.target,
        progress=not args.no_progress,
        callbacks=_loggers(args),
    )
    print(result.table.read_text())
    print(f"plot: {result.plot}\ntable: {result.table}")
    return 0


def cmd_partition(args: argparse.Namespace, extra: list[str]) -> int:
    from pyfedkern.data import partitions
    from pyfedkern.sim.parts import load_data

    data = load_data(args.dataset, args.data_root)
    part = partitions.make_partition(
        args.partition,
        data.y_train,
        args.clients,
        seed=args.seed,
        num_classes=data.num_classes,
        client_ids=data.client_ids,
    )
    print(part.summary_table(data.y_train, data.num_classes))
    if args.plot:
        print(f"plot: {part.plot(data.y_train, data.num_classes, args.plot)}")
    return 0


def cmd_info(args: argparse.Namespace, extra: list[str]) -> int:
    import pyfedkern

    info = pyfedkern.build_info()
    info["cuda_available"] = pyfedkern.cuda_available()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>22}: {value}")
    return 0


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from pyfedkern.benchmarks import runner

    families = FAMILIES if args.family == "all" else [args.family]
    print(runner.machine_load())
    for family in families:
        if family not in FAMILIES:
            raise CliError(f"unknown benchmark family {family!r}; valid choices: all, {', '.join(FAMILIES)}")
        rows = runner.run(family, quick=not args.full, progress=not args.no_progress)
        print(runner.report(rows))
    return 0


def cmd_reproduce(args: argparse.Namespace, extra: list[str]) -> int:
    if args.name is None:
        if args.help:
            args.parser.print_help()
            return 0
        raise CliError(f"name a reproduction: {', '.join(REPRODUCTIONS)} (`pyfedkern reproduce --help` says more)")
    if args.name not in REPRODUCTIONS:
        raise CliError(f"unknown reproduction {args.name!r}; valid choices: {', '.join(REPRODUCTIONS)}")
    module = importlib.import_module(REPRODUCTIONS[args.name])
    if args.help:  # the options above, then the reproduction's own (its parser prints them and exits)
        args.parser.print_usage()
        extra = ["--help"]
    return int(
        module.main(extra, out=Path(args.out or f"reproductions/{args.name}"), quick=args.quick, docs=args.docs) or 0
    )


def _reproduce_epilog() -> str:
    lines = ["reproductions (on the bundled digits; MNIST or CIFAR-10 too where --data-root holds their files):"]
    for name in REPRODUCTIONS:
        wrap = textwrap.TextWrapper(100, initial_indent=f"  {name:<10}", subsequent_indent=" " * 12)
        lines += wrap.wrap(SUMMARIES[name])
    lines.append("")
    lines.append("`pyfedkern reproduce NAME --help` lists NAME's own options (--seeds, --rounds, ...);")
    lines.append("docs/reproductions.md has what was measured.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pyfedkern", description="Fast federated-learning kernels and experiments.")
    parser.add_argument("--version", action="version", version=f"pyfedkern {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one FL experiment", allow_abbrev=False)
    algorithm = OPTIONS["algorithm"]
    run.add_argument("--algorithm", default=algorithm.default, help=f"{algorithm.help} (default: {algorithm.default})")
    run.add_argument("--out", default=None, help="directory for config, metrics, checkpoints and summary")
    run.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    run.add_argument("--help-algorithm", action="store_true", help="list the algorithm's parameters and exit")
    run.add_argument(
        "--workers",
        type=int,
        default=None,
        help="spread the rounds over N local processes (torch.distributed; at most the CPU cores, or one per GPU "
        "with --device cuda); under torchrun leave it out (default: one process)",
    )
    _add_common(run)
    run.set_defaults(parser=run, handler=cmd_run, takes_extra=True)

    cmp = sub.add_parser(
        "compare", allow_abbrev=False, help="run several algorithms on the same split; plot and tabulate"
    )
    cmp.add_argument("--algorithms", required=True, help="comma-separated names, e.g. fedavg,fedprox,scaffold")
    cmp.add_argument("--out", required=True, help="output directory (one sub-directory per algorithm)")
    cmp.add_argument("--target", type=float, default=None, help="accuracy target for rounds-to-target, e.g. 0.85")
    _add_common(cmp)
    cmp.set_defaults(parser=cmp, handler=cmd_compare, takes_extra=True)

    part = sub.add_parser("partition", allow_abbrev=False, help="print (and plot) how a partition splits a dataset")
    for name in ("dataset", "data_root", "partition", "clients"):
        _add_option(part, OPTIONS[name])
    _add_option(part, OPTIONS["seed"], "random seed of the split")
    part.add_argument("--plot", default=None, help="write a PNG of the per-client class counts")
    part.set_defaults(parser=part, handler=cmd_partition)

    rep = sub.add_parser(
        "reproduce",
        help=f"reproduce a paper's experiments ({', '.join(REPRODUCTIONS)})",
        description="Re-run a paper's experiments and write a report (report.md, plots) into --out.",
        epilog=_reproduce_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,
    )
    rep.add_argument("name", nargs="?", metavar="NAME", help=f"one of {', '.join(REPRODUCTIONS)}")
    rep.add_argument("-h", "--help", action="store_true", help="show this help (with NAME: NAME's own options too)")
    rep.add_argument("--out", default=None, help="output directory (default: reproductions/NAME)")
    rep.add_argument("--quick", action="store_true", help="a reduced run (fewer seeds/rounds) for a smoke check")
    rep.add_argument("--docs", default=None, help="update this markdown file's section (docs/reproductions.md)")
    rep.set_defaults(parser=rep, handler=cmd_reproduce, takes_extra=True)

    bench = sub.add_parser(
        "bench", allow_abbrev=False, help="quick kernel benchmarks: speedups over the usual PyTorch/NumPy way"
    )
    bench.add_argument("--family", default="aggregate", help=f"{' | '.join(FAMILIES)} | all (default: aggregate)")
    bench.add_argument("--full", action="store_true", help="all sizes (slow), not the quick subset")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(parser=bench, handler=cmd_bench)

    info = sub.add_parser("info", help="build info, CUDA availability, threads and versions")
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(parser=info, handler=cmd_info)
    parser.commands = tuple(sub.choices)
    return parser


def _one_line_warnings(command: str):
    """A ``warnings.showwarning`` that prints ``pyfedkern COMMAND: warning: MESSAGE`` (no source line)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"pyfedkern {command}: warning: {message}", file=sys.stderr)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Unknown options are algorithm parameters (run, compare) or go to the reproduction (reproduce).
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in parser.commands:
        near = _did_you_mean(argv[0], parser.commands)
        parser.error(f"unknown command {argv[0]!r}{near}; the commands are {', '.join(parser.commands)}")
    args, extra = parser.parse_known_args(argv)
    args.flags = {token.partition("=")[0] for token in argv if token.startswith("--")}  # the options given
    args.argv = argv
    if args.command in ("run", "compare", "partition") and "" not in sys.path:
        sys.path.insert(0, "")  # --model/--dataset package.module:factory import from the working directory
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command)
            if extra and not getattr(args, "takes_extra", False):
                hint = _did_you_mean(extra[0], _long_options(args.parser)) if extra[0].startswith("--") else ""
                raise CliError(f"unexpected argument(s): {' '.join(extra)}{hint}")
            if extra and args.command in ("run", "compare"):  # their extra options are algorithm parameters
                _refuse_typos(extra, _long_options(args.parser))
            return args.handler(args, extra)
    except (CliError, ValueError, TypeError, OSError, MemoryError) as exc:
        said = _out_of_memory() if isinstance(exc, MemoryError) else str(exc)
        if not os.environ.get(LAUNCHED_BY_WORKERS):
            print(f"pyfedkern {args.command}: error: {said}", file=sys.stderr)
        else:  # a rank of --workers tells its parent, which says the lowest rank's error; a rank that lost the
            # others keeps quiet (the one that stopped tells why)
            from pyfedkern.sim.distributed import RanksLost, tell_launcher

            if not isinstance(exc, RanksLost) and not tell_launcher(said) and os.environ.get("RANK") == "0":
                print(f"pyfedkern {args.command}: error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not os.environ.get(LAUNCHED_BY_WORKERS) and os.environ.get("RANK", "0") == "0":  # its parent says it
            print(f"pyfedkern {args.command}: {_interrupted(args)}", file=sys.stderr)
        return 130


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupted command left, and how to go on."""
    out = getattr(args, "out", None)
    if args.command == "run" and out and not (Path(out) / "config.json").exists():
        return f"interrupted before the run began (nothing was written to {out})"
    if args.command == "run" and out:
        return f"interrupted; {_left(args)}"
    if args.command == "run":
        return "interrupted (without --out nothing was saved)"
    if args.command == "compare":
        return (
            f"interrupted; run the same command again to go on: the finished runs in {out} are reused and the "
            "interrupted one resumed"
        )
    return "interrupted"


def _left(args: argparse.Namespace) -> str:
    """What a `run` that stopped early left: how to resume it (under torchrun, through torchrun; with --workers, the
    same number), or that nothing was saved."""
    if not args.out:
        return "without --out nothing was saved"
    if not (Path(args.out) / "config.json").exists():
        return f"nothing was written to {args.out}"
    command = f"pyfedkern run --resume --out {shlex.quote(args.out)}"
    if "RANK" in os.environ and not os.environ.get(LAUNCHED_BY_WORKERS):  # a rank that torchrun started
        return f"resume with `torchrun ... -m {command}`, launched as this run was (the same number of ranks)"
    return f"resume with `{command}{f' --workers {args.workers}' if args.workers else ''}`"


def _out_of_memory() -> str:
    """The error for a MemoryError: what this process may use, and what to make smaller."""
    import torch

    from pyfedkern.algorithms.batched import free_memory

    free = free_memory(torch.device("cpu"))
    return (
        f"out of memory: the command needs more than the {free / 2**30:.1f} GiB this process may use now (free RAM, "
        "its rlimits and cgroup limit); use fewer clients or less data, a smaller model, or train fewer participants "
        "at once (--client-chunk)"
    )


if __name__ == "__main__":
    sys.exit(main())
