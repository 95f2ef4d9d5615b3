"""The ``autopar`` command: plan, explain, run, demo, calibrate."""

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from autopar.core.errors import AutoparError


def _load_model(spec: str):
    """A built-in example (``autopar.examples.EXAMPLES``) or a Python file defining
    ``make_model()`` that returns ``(model, example_inputs)``."""
    from autopar.examples import EXAMPLES, check_example, make_example

    if spec in EXAMPLES:
        try:
            check_example(spec)
        except ModuleNotFoundError as exc:
            raise SystemExit(f"autopar plan: {exc}") from None
        return make_example(spec)
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(
            f"autopar plan: {spec!r} is neither a built-in model ({', '.join(sorted(EXAMPLES))}) nor a file"
        )
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "make_model"):
        raise SystemExit(f"autopar plan: {spec} must define make_model() returning (model, example_inputs)")
    return module.make_model()


def _plan(args) -> int:
    import autopar
    from autopar.demo import mesh_from

    model, inputs = _load_model(args.model)
    pins = {}
    for pin in args.pin:
        name, sep, placements = pin.partition("=")
        if not sep:
            raise SystemExit(f"autopar plan: --pin {pin!r} must look like NAME=S(0),R")
        pins[name] = tuple(p.strip() for p in placements.split(","))
    plan = autopar.plan(
        model,
        mesh_from(args.mesh, args.axes),
        inputs,
        hardware=args.hardware,
        pins=pins or None,
        memory_budget=args.memory_budget,
        share_layers={"auto": None, "on": True, "off": False}[args.share_layers],
        recompute=args.recompute,
        solver_time_limit_s=args.time_limit,
        solver_gap=args.solver_gap,
    )
    print(plan)
    if args.graph:
        print("\n" + autopar.annotated_graph(plan))
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nwrote {args.json}")
    return 0


def _explain(args) -> int:
    import autopar

    plan = autopar.ShardingPlan.from_json(Path(args.plan).read_text())
    print(plan)
    print("\n" + autopar.annotated_graph(plan))
    return 0


def _run(args, rest: list[str]) -> int:
    from autopar.api import TIMEOUT_VARIABLE
    from autopar.runtime.launch import torchrun

    if not rest:
        raise SystemExit("autopar run: name the script to run, e.g. autopar run -n 4 train.py")
    launcher = []
    for flag in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id"):
        value = getattr(args, flag)
        if value is not None:
            launcher.append(f"--{flag.replace('_', '-')}={value}")
    if args.nnodes is not None and args.rdzv_endpoint is not None:
        launcher.append("--rdzv-backend=c10d")
    if args.timeout is not None:
        if not args.timeout > 0:
            raise SystemExit(
                f"autopar run: --timeout {args.timeout:g}: give the seconds a collective may wait, e.g. 300"
            )
        os.environ[TIMEOUT_VARIABLE] = repr(args.timeout)  # the ranks inherit it
    return torchrun(args.n, rest, launcher_args=launcher)


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``autopar plan``: the model, the mesh and the options of :func:`autopar.plan`."""
    p.add_argument(
        "model",
        help="bert, convnet, gpt, llama, mlp, moe, hf-gpt2, hf-llama (Hugging Face transformers), "
        "or a .py file defining make_model() -> (model, example_inputs)",
    )
    p.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2, 8, 8x8 (default 2x2)")
    p.add_argument("--axes", default=None, help="axis names, comma-separated")
    p.add_argument(
        "--hardware",
        default="h100",
        help="h100, h200, a100, cpu, or a profile file from `autopar calibrate` (default h100)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME=P0,P1",
        help="fix a parameter's or input's placements, one per mesh axis, e.g. fc1.weight=R,S(0)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="per-device memory, e.g. 40GB or 512MiB: met by splitting, recomputing and (with a GPU profile) "
        "offloading to host memory",
    )
    p.add_argument(
        "--share-layers",
        choices=("auto", "on", "off"),
        default="auto",
        help="identical repeated layers share one choice: on, off, or when the program is large (default)",
    )
    p.add_argument(
        "--recompute",
        choices=("auto", "none", "layers"),
        default="auto",
        help="activations recomputed in the backward or offloaded: what the memory budget needs (auto, "
        "default), none, or every layer of a stack recomputed from its input (layers)",
    )
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds the solver may search (default 120)")
    p.add_argument(
        "--solver-gap",
        type=float,
        default=1e-3,
        help="stop at a plan proven within this fraction of the fastest (default 0.001; 0.01 is much "
        "sooner under a tight memory budget)",
    )
    p.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    p.add_argument("--graph", action="store_true", help="also print the annotated graph")


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``autopar`` parser and its ``run`` subparser, which :func:`main` uses alone so that the
    script's own arguments pass through. ``demo`` and ``calibrate`` are listed for ``--help`` only:
    their own ``main`` parses their arguments."""
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each stage")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_plan_arguments(sub.add_parser("plan", help="print the plan of a model for a mesh"))

    e = sub.add_parser("explain", help="print a saved plan and its annotated graph")
    e.add_argument("plan", help="a plan written by `autopar plan --json`")

    r = sub.add_parser("run", help="run a script on N ranks per host through torchrun")
    r.add_argument("-n", type=int, required=True, help="ranks per host")
    r.add_argument("--nnodes", default=None, help="hosts (torchrun --nnodes)")
    r.add_argument("--node-rank", dest="node_rank", default=None, help="this host's index")
    r.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", default=None, help="host:port of the rendezvous")
    r.add_argument("--rdzv-id", dest="rdzv_id", default=None, help="job id shared by all hosts")
    r.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a collective may wait for a rank that does not join it before every waiting rank fails "
        "(the default timeout of autopar.compile on each rank)",
    )

    sub.add_parser(
        "demo", help="plan a small GPT for 2x2, train on 4 local ranks, compare with one device", add_help=False
    )
    sub.add_parser(
        "calibrate", help="measure this machine's compute and gloo collectives into a profile file", add_help=False
    )
    return parser, r


def main(argv: list[str] | None = None) -> int:
    """Run the ``autopar`` command line ``argv`` (default: this process's) and return its exit status.
    ``demo``, ``calibrate`` and ``run`` hand the rest of the line on; ``plan`` and ``explain`` report
    a user's error in one line, with the traceback only under ``-v``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, run_parser = _parser()
    if argv[:1] == ["calibrate"]:
        from autopar.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv[:1] == ["demo"]:
        from autopar.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["run"]:
        known, rest = run_parser.parse_known_args(argv[1:])
        return _run(known, rest)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("torch").setLevel(logging.WARNING)
    try:
        return {"plan": _plan, "explain": _explain}[args.command](args)
    except (AutoparError, ValueError, TypeError, OSError) as exc:
        if args.verbose:
            raise
        raise SystemExit(f"autopar {args.command}: {exc}\n(run with -v for the traceback)") from None


if __name__ == "__main__":
    sys.exit(main())
