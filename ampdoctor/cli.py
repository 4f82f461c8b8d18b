"""The `ampdoctor` command line: report, replay, doctor. Exit codes per shared/CONTRACT.md:
0 no error findings, 1 at least one error finding, 2 bad input or usage (one line on stderr, no traceback)."""
from __future__ import annotations

import argparse
import os
import sys

from .errors import BadInput

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line, exit 2
        print(f"ampdoctor: {message} (see `ampdoctor --help`)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ampdoctor", description="Why did my mixed-precision (fp16/bf16) training break?")
    from . import __version__
    p.add_argument("--version", action="version", version=f"ampdoctor {__version__}")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    r = sub.add_parser("report", help="diagnose a run directory written by ampdoctor.watch(run_dir=...)")
    r.add_argument("run_dir")
    _model_args(r, "builds the model to replay the run's capture with, naming the op")
    _output_args(r)
    r.add_argument("--tensorboard", help="write TensorBoard scalars under DIR")
    r.add_argument("--rules", help="comma-separated rule ids to run (default: all)")
    q = sub.add_parser("replay", help="re-run a capture with op-level instrumentation")
    q.add_argument("capture")
    _model_args(q, "builds the model (when the capture has no Hugging Face config)")
    _output_args(q)
    q.add_argument("--quick", action="store_true", help="op-level origin only (no shadow, what-if, fix search)")
    d = sub.add_parser("doctor", help="check the environment (GPU, TF32, bf16) and optionally a DeepSpeed config")
    d.add_argument("--deepspeed", help="a DeepSpeed JSON config whose fp16/bf16 block to check")
    d.add_argument("--json", help="write the findings as JSON to FILE")
    return p


def _model_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("--model", help=f"pkg.module:factory that {model_help}")
    p.add_argument("--loss", help="pkg.module:fn, loss_fn(output, *args, **kwargs) -> scalar")


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write index.html and plots under DIR (default reports/<name>/)")
    p.add_argument("--json", help="write the report as JSON to FILE")
    p.add_argument("--no-html", action="store_true", help="do not write the HTML report")


def _resolve(spec: str, what: str):
    import importlib
    if ":" not in spec:
        raise BadInput(f"--{what} must look like package.module:name, got {spec!r}")
    mod, _, name = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"cannot import {spec!r} for --{what}: {e}") from None
    return obj


def _build(spec: str):
    """--model pkg.mod:factory -> an nn.Module (the factory is called with no arguments)."""
    import torch.nn as nn
    model = _resolve(spec, "model")
    if not isinstance(model, nn.Module) and callable(model):
        try:
            model = model()
        except Exception as e:
            raise BadInput(f"--model factory {spec} failed: {type(e).__name__}: {e}") from None
    return model


def _default_out(path: str) -> str:
    name = os.path.basename(os.path.normpath(path)) or "report"
    return os.path.join("reports", name)


def _write(report, args, src: str) -> None:
    from .report.text import render_text
    print(render_text(report))
    if args.json:
        report.save_json(args.json)
        print(f"json: {args.json}")
    if not getattr(args, "no_html", False):
        out = args.out or _default_out(src)
        path = report.save_html(out)
        try:
            from .report.plots import write_plots
            write_plots(report, out)
        except Exception as e:  # plots are a bonus beside the self-contained HTML
            print(f"ampdoctor: plots skipped ({e})", file=sys.stderr)
        print(f"report: {path}")


def _cmd_report(args) -> int:
    from .analysis import build_report, diagnose_run_dir
    from .rules import RuleConfig
    if args.rules:
        cfg = RuleConfig(only=tuple(r.strip() for r in args.rules.split(",") if r.strip()))
        from .rundir import find_rank_dirs, read_run
        ranks = find_rank_dirs(args.run_dir)
        meta, steps = read_run(ranks[0][1])
        report = build_report(meta, steps, run_dir=args.run_dir, config=cfg)
    else:
        report = diagnose_run_dir(args.run_dir)
    if args.model:
        from .analysis import merge_capture_replay
        from .rundir import find_rank_dirs, read_run
        model = _build(args.model)
        loss = _resolve(args.loss, "loss") if args.loss else None
        steps = [s for _, path in find_rank_dirs(args.run_dir) for s in read_run(path)[1]]
        report = merge_capture_replay(report, steps, model, loss, strict=True)
    if args.tensorboard:
        from .report.tensorboard import write_tensorboard
        from .rundir import find_rank_dirs, read_run
        for rank, path in find_rank_dirs(args.run_dir):
            meta, steps = read_run(path)
            write_tensorboard(meta, steps, args.tensorboard if rank is None else
                              os.path.join(args.tensorboard, f"rank-{rank}"))
        print(f"tensorboard: {args.tensorboard}")
    _write(report, args, args.run_dir)
    return report.exit_code


def _cmd_replay(args) -> int:
    from .replay import replay
    if not os.path.exists(args.capture):
        raise BadInput(f"{args.capture}: no such capture")
    model = _build(args.model) if args.model else None
    loss = _resolve(args.loss, "loss") if args.loss else None
    kw = dict(shadow=False, whatif=False, fix_search=False) if args.quick else {}
    report = replay(args.capture, model=model, loss_fn=loss, progress=lambda s: print(s, file=sys.stderr), **kw)
    _write(report, args, args.capture)
    return report.exit_code


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor
    report = run_doctor(deepspeed=args.deepspeed)
    from .report.text import render_text
    print(render_text(report))
    if args.json:
        report.save_json(args.json)
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd is None:
        _parser().print_help()
        return 2
    try:
        return {"report": _cmd_report, "replay": _cmd_replay, "doctor": _cmd_doctor}[args.cmd](args)
    except BadInput as e:
        print(f"ampdoctor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ampdoctor: interrupted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
