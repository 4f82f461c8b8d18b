"""The package's import graph: no import cycle, and no stage imports a later one (shared/STYLE.md item 8).

    base (shared types) -> record (the watch) -> rules -> analysis | replay -> report -> cli, trainer integrations

Module-level imports only: an API method may import a later stage inside its body (`Watch.report()` builds a
Report; `maybe_capture` writes the capture format) — that runs after the package is loaded and makes no cycle.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ampdoctor")

STAGES = {
    0: ("ampdoctor", "errors", "config", "records", "recordcodec", "thresholds", "findings", "fixes", "tensors",
        "fsutil", "env", "capture", "capturecheck", "capturestruct"),
    1: ("record", "watch", "exits", "rundir", "runcaptures",
        "integrations.deepspeed"),   # DeepSpeed's engine patch is a recorder part (like monitor's scaler patch)
    2: ("rules",),
    3: ("analysis", "analysis.ranking", "analysis.panels", "analysis.merging", "analysis.replaychoice", "analysis.replayfold",
        "analysis.replayscaler", "summary", "doctor", "replay"),
    4: ("report",),
    5: ("cli", "__main__", "integrations"),
}


def stage(mod: str) -> int:
    """The stage of a dotted module name below `ampdoctor.` (longest matching prefix wins)."""
    rel = mod[len("ampdoctor."):] if mod != "ampdoctor" else "ampdoctor"
    best, n = None, -1
    for s, names in STAGES.items():
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and len(name) > n:
                best, n = s, len(name)
    assert best is not None, f"{mod} has no stage in tests/test_imports.py: place it"
    return best


def modules() -> dict[str, str]:
    out = {}
    for dp, _, fs in os.walk(ROOT):
        for f in fs:
            if f.endswith(".py"):
                p = os.path.join(dp, f)
                name = "ampdoctor" + p[len(ROOT):-3].replace(os.sep, ".")
                out[name[:-9] if name.endswith(".__init__") else name] = p
    return out


def edges() -> dict[str, set[str]]:
    mods = modules()
    out: dict[str, set[str]] = {}
    for m, p in mods.items():
        pkg = m if p.endswith("__init__.py") else m.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.parse(open(p).read()).body:
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                subs = [target + "." + a.name for a in node.names if target + "." + a.name in mods]
                deps.update(subs)
                if target in mods and len(subs) < len(node.names):
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
        out[m] = deps - {m}
    return out


def test_no_import_cycle():
    g = edges()
    state: dict[str, int] = {}
    cycles = []

    def visit(u, path):
        state[u] = 1
        path.append(u)
        for v in sorted(g[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(path[path.index(v):] + [v]))
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = 2
    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_no_stage_imports_a_later_one():
    up = [f"{m} (stage {stage(m)}) imports {d} (stage {stage(d)})"
          for m, ds in edges().items() for d in ds if stage(d) > stage(m)]
    assert not up, up


def test_the_checks_see_the_graph():
    """The walker is not vacuous: on the real package it finds the rules registry edges, and `stage` places
    every module."""
    g = edges()
    assert "ampdoctor.rules.registry" in g["ampdoctor.rules.origins"]
    assert all(isinstance(stage(m), int) for m in g)
    assert stage("ampdoctor.report.html") > stage("ampdoctor.rules.origins") > stage("ampdoctor.record.transfer")
    assert {"ampdoctor.analysis.ranking", "ampdoctor.analysis.merging", "ampdoctor.analysis.replayfold"} <= \
        g["ampdoctor.analysis"]
    assert "ampdoctor.analysis.panels" in g["ampdoctor.analysis.ranking"]
    assert "ampdoctor.analysis.ranking" in g["ampdoctor.analysis.merging"]
    assert "ampdoctor.rules" in g["ampdoctor.analysis.panels"]
    assert {"ampdoctor.record.assemble", "ampdoctor.record.headroom"} <= g["ampdoctor.record.step"]
    assert "ampdoctor.record.transfer" in g["ampdoctor.record.assemble"]
    assert "ampdoctor.record.readback" in g["ampdoctor.record.transfer"]


def test_rules_analysis_and_reporters_never_import_the_recorder():
    """Rules are pure functions over records: they, the analysis and the reporters read records, never the
    recorder's modules (ampdoctor/rules/__init__.py); replay may (it re-runs a step with the same statistics)."""
    g = edges()
    bad = {m: sorted(d for d in deps if d == "ampdoctor.record" or d.startswith("ampdoctor.record."))
           for m, deps in g.items()
           if m.startswith(("ampdoctor.rules", "ampdoctor.analysis", "ampdoctor.report"))}
    assert not {m: d for m, d in bad.items() if d} , bad
