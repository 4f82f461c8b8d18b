"""The `ampdoctor` command line: report, replay, doctor. Exit codes per shared/CONTRACT.md:
0 no error findings, 1 at least one error finding, 2 bad input or usage (one line on stderr, no traceback).

Arguments are parsed before anything heavy is imported (torch, transformers, matplotlib), so `--help` and
usage errors answer at once. Every output path is checked before any work starts: `--out` only into a new or
empty directory or one ampdoctor wrote (`--force` overrides), `--json` never onto a directory, nothing
unwritable. Output to a closed pipe (`| head`) ends quietly.
"""
from __future__ import annotations

import argparse
import os
import sys

from .errors import BadInput

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line, exit 2
        raise BadInput(f"{message} (see `ampdoctor --help`)")


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
    p.add_argument("--out", help="write index.html and plots under DIR (default reports/<name>/); only a new or "
                                 "empty directory, or one ampdoctor wrote")
    p.add_argument("--force", action="store_true", help="let --out write into a directory that holds other files")
    p.add_argument("--json", help="write the report as JSON to FILE")
    p.add_argument("--no-html", action="store_true", help="do not write the HTML report")


# ------------------------------------------------------------------------------------------------ output
_pipe_closed = False


def _say(text: str) -> None:
    """print() to stdout; a reader that went away (`| head -3`) silences the rest instead of a traceback."""
    global _pipe_closed
    if _pipe_closed:
        return
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _pipe_closed = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that go nowhere
        os.close(devnull)


def _default_out(path: str) -> str:
    name = os.path.basename(os.path.normpath(path)) or "report"
    return os.path.join("reports", name)


def _check_outputs(args, src: str) -> None:
    """Refuse unusable output paths before any work is done (one line, exit 2)."""
    from .fsutil import check_out_dir, check_out_file
    for opt in ("json", "out", "tensorboard"):  # an empty path is not "not given": say so rather than guess
        if getattr(args, opt, None) == "":
            raise BadInput(f"--{opt}: the path is empty")
    if getattr(args, "json", None):
        check_out_file(args.json, "--json")
        j, root = os.path.realpath(args.json), os.path.realpath(src)
        if os.path.lexists(args.json) and (j == root or j.startswith(root.rstrip(os.sep) + os.sep)):
            raise BadInput(f"--json {args.json}: is a file of {src} itself; write the report elsewhere")
    if getattr(args, "loss", None):  # a bad spec is bad input even where --loss would go unused
        from .replay.modelio import resolve
        resolve(args.loss, "--loss")
    if hasattr(args, "no_html") and not args.no_html:
        check_out_dir(args.out or _default_out(src), "--out", force=args.force)
        if getattr(args, "json", None):  # (the HTML would be written over the JSON, or the JSON over a plot)
            from .fsutil import OUT_MARKER
            from .report.plots import PLOT_FILES
            out, j = os.path.realpath(args.out or _default_out(src)), os.path.realpath(args.json)
            if os.path.dirname(j) == out and os.path.basename(j) in {"index.html", OUT_MARKER, *PLOT_FILES.values()}:
                raise BadInput(f"--json {args.json}: the HTML report writes {os.path.basename(j)} into its --out "
                               "directory; write the JSON elsewhere")
    if getattr(args, "tensorboard", None):
        check_out_dir(args.tensorboard, "--tensorboard", force=True)


def _write(report, args, src: str) -> None:
    from .fsutil import mark_out_dir
    from .report.text import render_text
    _say(render_text(report))
    try:
        if args.json:
            try:
                report.save_json(args.json)
            except OSError as e:  # (the message names the path given, not the temporary file beside it)
                raise BadInput(f"--json {args.json}: cannot write ({e.strerror or e})") from None
            _say(f"json: {args.json}")
        if not args.no_html:
            out = args.out or _default_out(src)
            path = report.save_html(out)   # index.html and the plot PNGs beside it (report/html.write_html)
            mark_out_dir(out)
            _say(f"report: {path}")
    except OSError as e:
        raise BadInput(f"cannot write the report: {e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None


# ------------------------------------------------------------------------------------------------ commands
def _rules(spec: str | None):
    if spec is None:
        return None
    ids = tuple(r.strip() for r in spec.split(",") if r.strip())
    if not ids:
        raise BadInput(f"--rules {spec!r} names no rule; give comma-separated rule ids, or leave --rules out to "
                       "run all")
    from .rules import RuleConfig
    return RuleConfig(only=ids)


def _own_capture(run: str, cap: str | None) -> str | None:
    """A record's capture as this run dir holds it: `run/captures/<name>` (a run dir that was moved keeps its
    captures; a record naming a path elsewhere is never followed), None when the run dir has no such capture."""
    if not cap:
        return None
    own = os.path.join(run, "captures", os.path.basename(os.path.normpath(str(cap))))
    return own if os.path.isdir(own) and not os.path.islink(own) else None


def _cmd_report(args) -> int:
    cfg = _rules(args.rules)
    from .rundir import find_rank_dirs
    ranks = find_rank_dirs(args.run_dir)
    _check_outputs(args, args.run_dir)
    from .analysis import diagnose_run_dir
    from .rundir import read_run
    report = diagnose_run_dir(args.run_dir, saved_replay=not args.model)  # --model: replayed afresh below
    if args.model:
        from .analysis import merge_capture_replay
        from .replay.modelio import build_model, resolve
        model = build_model(None, args.model)
        loss = resolve(args.loss, "--loss") if args.loss else None
        steps = []
        for _, path in ranks:
            for st in read_run(path)[1]:
                st.capture = _own_capture(path, st.capture)
                steps.append(st)
        own = {_own_capture(path, c) for _, path in ranks for c in report.summary.get("captures") or []}
        report.summary["captures"] = sorted(c for c in own if c)
        report = merge_capture_replay(report, steps, model, loss, strict=True)
    if args.tensorboard:
        from .report.tensorboard import write_tensorboard
        try:
            for rank, path in ranks:
                meta, steps = read_run(path)
                write_tensorboard(meta, steps, args.tensorboard if rank is None else
                                  os.path.join(args.tensorboard, f"rank-{rank}"))
        except OSError as e:
            raise BadInput(f"--tensorboard {args.tensorboard}: cannot write ({e.strerror or e})") from None
        _say(f"tensorboard: {args.tensorboard}")
    if cfg is not None:  # the whole diagnosis (every rank, the saved or fresh replay), then only these rules' findings
        from .summary import only_rules
        report = only_rules(report, cfg.only)
    _write(report, args, args.run_dir)
    return report.exit_code


def _cmd_replay(args) -> int:
    if not os.path.exists(args.capture):
        raise BadInput(f"{args.capture}: no such capture")
    _check_outputs(args, args.capture)
    from .replay import modelio, replay
    model = modelio.build_model(None, args.model) if args.model else None
    loss = modelio.resolve(args.loss, "--loss") if args.loss else None
    kw = dict(shadow=False, whatif=False, fix_search=False) if args.quick else {}
    # progress lines on an interactive terminal only: piped, stderr carries nothing but a failure's one line
    say = (lambda s: print(s, file=sys.stderr)) if sys.stderr.isatty() else None
    report = replay(args.capture, model=model, loss_fn=loss, progress=say, **kw)
    _write(report, args, args.capture)
    return report.exit_code


def _cmd_doctor(args) -> int:
    if args.json:
        from .fsutil import check_out_file
        check_out_file(args.json, "--json")
    from .doctor import run_doctor
    report = run_doctor(deepspeed=args.deepspeed)
    from .report.text import render_text
    _say(render_text(report))
    if args.json:
        try:
            report.save_json(args.json)
        except OSError as e:
            raise BadInput(f"--json {args.json}: cannot write ({e.strerror or e})") from None
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    try:
        p = _parser()
        args = p.parse_args(argv)
        if args.cmd is None:
            raise BadInput("a command is required: report, replay or doctor (see `ampdoctor --help`)")
        return {"report": _cmd_report, "replay": _cmd_replay, "doctor": _cmd_doctor}[args.cmd](args)
    except BadInput as e:
        print(f"ampdoctor: {str(e).splitlines()[0] if str(e) else 'bad input'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ampdoctor: interrupted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
