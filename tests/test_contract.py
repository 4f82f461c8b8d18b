"""shared/CONTRACT.md as a test: every public name, field and rule id, callable and shaped as written."""
import importlib
import json
import subprocess
import sys

import torch
import torch.nn as nn

import ampdoctor
from ampdoctor.rules import RULE_IDS

CONTRACT_RULES = {"overflow", "nan_origin", "overflow_risk", "underflow", "loss_scale_collapse", "skipped_steps",
                  "clip_before_unscale", "scaler_misorder", "missing_scaler_update", "update_underflow",
                  "fp16_master_weights", "mask_value_overflow", "eps_underflow", "precision_loss", "env_tf32",
                  "headroom_trend", "update_spike", "deprecated_api", "replay_error"}


def test_api_names_stay_callable_after_submodules_load():
    for mod in ("ampdoctor.replay", "ampdoctor.capture", "ampdoctor.watch", "ampdoctor.analysis",
                "ampdoctor.report.html", "ampdoctor.integrations"):
        importlib.import_module(mod)
    for name in ("watch", "diagnose", "save_batch", "replay"):
        assert callable(getattr(ampdoctor, name)) and not isinstance(getattr(ampdoctor, name), type(sys)), name


def test_finding_json_shape_and_rule_ids(tmp_path):
    assert set(RULE_IDS) == CONTRACT_RULES
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        m[1].weight.mul_(1e6)
    with ampdoctor.watch(m, every=1) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            m(torch.randn(2, 4) * 100).float().sum().backward()
    rep = w.report()
    d = rep.to_dict()
    assert set(d) >= {"findings", "summary"}
    f = d["findings"][0]
    assert list(f) == ["rule", "severity", "phase", "module", "op", "step", "message", "fix", "evidence"]
    assert f["severity"] in ("error", "warning", "info") and f["phase"] in ("forward", "backward", "optimizer",
                                                                          "scaler", "env", None)
    json.dumps(d)  # JSON-ready
    rep.save_json(tmp_path / "r.json")
    rep.save_html(tmp_path / "html")
    assert (tmp_path / "html" / "index.html").exists()
    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["rule"] == f["rule"]


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "--help"], capture_output=True, text=True).stdout
    assert "report" in out and "replay" in out
