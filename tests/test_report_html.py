"""HTML reporter: structure and escaping from Python, then the page as a user sees it in headless Chromium.

The browser tests drive the system Chromium over the DevTools pipe (tests/chromium_cdp.py; no driver package,
no browser download) and skip only when no Chromium is installed.
"""
from __future__ import annotations

import os
import re

import pytest

import report_samples as rs
from ampdoctor.report import panels
from ampdoctor.report.html import render_html, write_html
from chromium_cdp import Browser, find_chromium

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def overflow_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("overflow")
    return out, write_html(rs.overflow_report(), out)


def test_directory_gets_index_and_plots(overflow_dir):
    out, path = overflow_dir
    assert path == os.path.join(str(out), "index.html")
    assert sorted(os.listdir(out)) == ["grad_norms.png", "headroom_heatmap.png", "index.html", "loss_scale.png"]


def test_file_path_and_user_files_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    p = write_html(rs.healthy_report(), tmp_path / "r.html")
    assert p.endswith("r.html") and os.path.getsize(p) > 1000
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "r.html"]
    assert rs.healthy_report().save_html(tmp_path / "sub") == str(tmp_path / "sub" / "index.html")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_self_contained(overflow_dir):
    html = open(overflow_dir[1], encoding="utf-8").read()
    assert "Content-Security-Policy" in html
    # every src/href is a data: URI or an in-page anchor; no http(s), no @import, no url() fetches
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith(("data:", "#")), ref
    assert "http://" not in html and "https://" not in html and "@import" not in html and "url(" not in html
    assert html.count("data:image/png;base64,") == 3


def test_first_screen_content(overflow_dir):
    html = open(overflow_dir[1], encoding="utf-8").read()
    hero = html[html.index('id="summary"'):html.index('id="findings"')]
    assert rs.ROOT_MODULE in hero and "aten::mm" in hero and "step</b>23" in hero
    assert "autocast(&#39;cuda&#39;, enabled=False)" in hero      # the fix snippet, escaped
    # ranked: the root cause's card comes before its consequences
    order = [html.index(f'class="rule">{r}<') for r in ("overflow", "loss_scale_collapse", "nan_origin")]
    assert order == sorted(order)
    assert 'class="misordered"' in html and "OUT OF ORDER" in html
    for section in ("layers", "heatmap", "timeline", "grad-norms", "calls", "replay", "env"):
        assert f'id="{section}"' in html


def test_healthy_state():
    html = render_html(rs.healthy_report(), plots={})
    assert "Healthy: no problems found" in html and "Root cause" not in html


def test_replay_only_and_empty_report():
    html = render_html(rs.replay_only_report(), plots={})
    assert 'id="replay"' in html and 'id="whatif"' in html and 'id="layers"' not in html
    assert "bfloat16" in html and "0.0031" in html
    assert "mask_value_overflow: value -3.403e+38" in html and "1 non-finite: lm_head.weight" in html
    assert "RuntimeError: CUDA out of memory" in html
    from ampdoctor.findings import Report
    assert "Healthy: no problems found" in render_html(Report(), plots={})


def test_everything_escaped():
    html = render_html(rs.hostile_report(), plots={})
    assert "<script>window.__pwned" not in html and "<img src=x" not in html
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html


def test_large_report_size_and_worst_value(tmp_path):
    rep = rs.large_report()                                # 500 layers x 1,000 steps, worst cell (337, 613)
    ds = panels.downsample_heatmap(rep.to_dict()["heatmap"], max_modules=60, max_steps=300)
    assert ds["worst"]["module"] == "model.layers.67.attn.v" and ds["worst"]["step"] == 613
    flat = [v for row in ds["headroom"] for v in row if v is not None]
    assert min(flat) == -3.25                              # the worst cell survived binning
    i, j = ds["worst"]["cell"]
    assert ds["headroom"][i][j] == -3.25 and ds["modules"][i].startswith("model.layers.67.attn.v")
    p = write_html(rep, tmp_path / "big.html")
    size = os.path.getsize(p)
    assert size <= 5 * 1024 * 1024, size
    html = open(p, encoding="utf-8").read()
    assert html.count("<tr>") >= 500                       # every layer is in the table
    assert 'data-v="-3.25"' in html                        # with its worst headroom


# --- in a real browser ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    b = Browser(CHROMIUM)
    b.open_page()
    yield b
    b.close()


def _url(path):
    return "file://" + os.path.abspath(path)


@needs_chromium
def test_browser_loads_cleanly_and_shows_verdict(browser, overflow_dir):
    browser.navigate(_url(overflow_dir[1]))
    seen = browser.problems()
    assert seen["errors"] == []
    bad = [u[:80] for u in seen["urls"] if not u.startswith(("file:", "data:"))]
    assert bad == []
    verdict = browser.eval("""(() => { const e = document.getElementById('verdict'); const r = e.getBoundingClientRect();
        return {text: e.innerText, top: r.top, bottom: r.bottom, h: innerHeight,
                visible: getComputedStyle(e).visibility === 'visible' && r.height > 0}; })()""")
    assert verdict["visible"] and 0 <= verdict["top"] and verdict["bottom"] <= verdict["h"]   # on the first screen
    assert rs.ROOT_MODULE in verdict["text"] and "step 23" in verdict["text"]
    imgs = browser.eval("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
    assert imgs == [True, True, True]


@needs_chromium
def test_browser_header_click_sorts_layer_table(browser, overflow_dir):
    browser.navigate(_url(overflow_dir[1]))
    col = "Array.from(document.querySelectorAll('#layer-table tbody tr')).map(r => r.cells[%d].getAttribute('data-v'))"
    before = browser.eval(col % 0)
    browser.click("#layer-table thead th:nth-child(5)")          # headroom (bits)
    hr = [float(v) for v in browser.eval(col % 4)]
    assert hr == sorted(hr) and hr[0] == float("-inf")
    assert browser.eval(col % 0)[0] == rs.ROOT_MODULE            # the overflowing layer comes first
    browser.click("#layer-table thead th:nth-child(5)")          # again: descending
    assert [float(v) for v in browser.eval(col % 4)] == sorted(hr, reverse=True)
    browser.click("#layer-table thead th:nth-child(1)")          # by name
    names = browser.eval(col % 0)
    assert names == sorted(names, key=str.lower) and sorted(names) == sorted(before)


@needs_chromium
def test_browser_hostile_names_stay_text(browser, tmp_path):
    p = write_html(rs.hostile_report(), tmp_path / "evil.html")
    browser.navigate(_url(p))
    assert browser.eval("typeof window.__pwned") == "undefined"
    assert browser.problems()["errors"] == []
    assert "<script>window.__pwned=1</script>" in browser.eval("document.getElementById('verdict').innerText")


@needs_chromium
def test_browser_screenshot(browser, overflow_dir, tmp_path):
    browser.navigate(_url(overflow_dir[1]))
    shot = tmp_path / "report.png"
    png = browser.screenshot(str(shot))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    import matplotlib.image as mpimg
    img = mpimg.imread(str(shot))
    assert img.shape[0] >= 800 and img.shape[1] >= 1200
    assert img[..., :3].std() > 0.05                              # not a blank page
    if os.environ.get("AMPDOCTOR_SCREENSHOT_DIR"):
        import shutil
        shutil.copy(shot, os.path.join(os.environ["AMPDOCTOR_SCREENSHOT_DIR"], "report.png"))


# --- real runs in the browser (issue 16: the report a newcomer trusts at a glance) ---------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Pages built from real runs: a NaN run, a short healthy run, a crash, the T5 replay, a replay without loss."""
    import ampdoctor
    base = tmp_path_factory.mktemp("real")
    runs = {"nan": rs.nan_run(base / "nan_run"), "healthy": rs.short_healthy_run(base / "healthy_run")}
    reports = {k: ampdoctor.diagnose(v) for k, v in runs.items()}
    crash_rep, err = rs.crashed_run()
    if not crash_rep.summary.get("crash"):   # summary["crash"] not landed yet: the documented shape, from the run
        crash_rep.summary["crash"] = {"step": 0, "type": type(err).__name__, "message": str(err).splitlines()[0],
                                      "module": "attn", "file": None, "line": None}
        crash_rep.summary["verdict"] = "Crashed: " + crash_rep.summary.get("verdict", "")
    reports.update(crash=crash_rep, replay=rs.replay_fixture(), noloss=rs.replay_without_loss(base / "cap"))
    pages = {k: write_html(r, base / f"page_{k}") for k, r in reports.items()}
    return {"runs": runs, "reports": reports, "pages": pages, "base": base}


_CELLS_JS = """(async () => {
  const sec = document.getElementById('heatmap'); const img = sec.querySelector('img.plot');
  await img.decode();
  const W = img.naturalWidth, H = img.naturalHeight;
  const c = document.createElement('canvas'); c.width = W; c.height = H;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  return Array.from(sec.querySelectorAll('.plotwrap .row')).map(r => {
    const s = r.style, cols = +r.dataset.cols;
    const left = parseFloat(s.left) / 100 * W, top = parseFloat(s.top) / 100 * H;
    const width = parseFloat(s.width) / 100 * W, height = parseFloat(s.height) / 100 * H;
    const y = Math.round(top + height / 2), cells = [];
    for (let j = 0; j < cols; j++) {
      const p = g.getImageData(Math.round(left + (j + 0.5) * width / cols), y, 1, 1).data;
      cells.push(Math.max(p[0], p[1], p[2]));
    }
    return {module: r.dataset.module, title: r.title, cells: cells};
  });
})()"""

# all text a person reads as prose: every text node outside <pre> (code keeps its own characters)
_PROSE_JS = """(() => { const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT); const out = [];
  while (w.nextNode()) { const n = w.currentNode; if (!n.parentElement.closest('pre, script, style')) out.push(n.textContent); }
  return out.join(' '); })()"""


def _open(browser, page):
    browser.navigate(_url(page))
    assert browser.problems()["errors"] == []


@needs_chromium
def test_browser_nonfinite_rows_black_and_culprit_named(browser, real):
    """Every heatmap cell whose layer output was inf/NaN is black, every other cell is not; the callout names
    the layer the root finding names (blocks.1), not the root module that merely carries the NaN."""
    _open(browser, real["pages"]["nan"])
    rows = browser.eval(_CELLS_JS)
    hm = real["reports"]["nan"].to_dict()["heatmap"]
    assert [r["module"] for r in rows] == [m or "(root)" for m in hm["modules"]]
    n_black = 0
    for r, values in zip(rows, hm["headroom"]):
        for px, v in zip(r["cells"], values):
            x = panels.num(v)
            if x is not None and not (x == x and x > float("-inf")):      # -inf / nan: the output was not finite
                assert px < 40, (r["module"], v, px)
                n_black += 1
            else:
                assert px > 80, (r["module"], v, px)
    assert n_black >= 5 * len(hm["steps"])          # blocks.1 and the layers after it, on every step
    bad = {r["module"] for r in rows if "inf/NaN" in r["title"]}
    assert {"blocks.1", "blocks.1.mlp", "ln", "head"} <= bad and "blocks.0" not in bad
    caption = browser.eval("document.querySelector('#heatmap .caption').innerText")
    assert caption.startswith("Circled: blocks.1 at step 0") and "(root)" not in caption


@needs_chromium
def test_browser_no_empty_plot(browser, real):
    """A plot with nothing to show is one sentence saying why and what to pass; every image shown has content."""
    _open(browser, real["pages"]["healthy"])
    seen = browser.eval("""Array.from(document.querySelectorAll('section')).filter(s => ['heatmap', 'timeline',
        'grad-norms'].includes(s.id)).map(s => ({id: s.id, img: !!s.querySelector('img'),
        empty: (s.querySelector('p.empty') || {}).innerText || ''}))""")
    by_id = {s["id"]: s for s in seen}
    assert not by_id["heatmap"]["img"] and "step 0 only" in by_id["heatmap"]["empty"]
    assert "every=1" in by_id["heatmap"]["empty"]
    assert not by_id["grad-norms"]["img"] and "every=1" in by_id["grad-norms"]["empty"]
    assert by_id["timeline"]["img"]
    _open(browser, real["pages"]["nan"])
    empty = browser.eval("(document.querySelector('#grad-norms p.empty') || {}).innerText || ''")
    assert "inf/NaN" in empty and not browser.eval("!!document.querySelector('#grad-norms img')")
    for page in real["pages"].values():
        _open(browser, page)
        assert all(browser.eval("Array.from(document.images).map(i => i.complete && i.naturalWidth > 100)"))


@needs_chromium
def test_browser_fix_once_no_backticks_labelled_evidence(browser, real):
    rep = real["reports"]["replay"]
    _open(browser, real["pages"]["replay"])
    text = browser.eval("document.body.innerText")
    for line in ("def run_in_fp32(module", "out = self.wo(x.float())"):
        assert text.count(line) == 1, line                       # the fix, once: in the top card
    head = browser.eval("document.getElementById('verdict').innerText")
    assert rep.findings[0].message not in head                    # the headline does not repeat the message
    assert browser.eval("document.getElementById('message').innerText") == rep.findings[0].message.replace("`", "")
    labels = browser.eval("Array.from(document.querySelectorAll('.finding')[0].querySelectorAll('dt')).map(d => d.innerText)")
    assert any(t.startswith("absmax_in") and "op's inputs (aten::mm)" in t for t in labels)
    _open(browser, real["pages"]["nan"])
    labels = browser.eval("Array.from(document.querySelectorAll('.finding')[0].querySelectorAll('dt')).map(d => d.innerText)")
    assert any(t.startswith("absmax_in") and "module's inputs" in t for t in labels)
    for name, page in real["pages"].items():
        _open(browser, page)
        prose_text = browser.eval(_PROSE_JS)
        assert "`" not in prose_text, (name, prose_text[prose_text.index("`") - 60:][:120])


@needs_chromium
def test_browser_whatif_dtype_on_one_line(browser, real):
    browser.send("Emulation.setDeviceMetricsOverride", {"width": 360, "height": 800, "deviceScaleFactor": 1,
                                                         "mobile": False})
    try:
        _open(browser, real["pages"]["replay"])
        lines = browser.eval("Array.from(document.querySelectorAll('#whatif tbody tr td:first-child code'))"
                             ".map(c => [c.innerText, c.getClientRects().length])")
    finally:
        browser.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 900, "deviceScaleFactor": 1,
                                                             "mobile": False})
    assert ["bfloat16", 1] in lines and all(n == 1 for _, n in lines)


@needs_chromium
def test_browser_replay_without_loss_says_backward_not_run(browser, real):
    assert real["reports"]["noloss"].to_dict()["replay"]["chain"][-2] == {"stage": "loss", "finite": None}
    _open(browser, real["pages"]["noloss"])
    chain = browser.eval("document.getElementById('chain').innerText")
    assert "backward was not run" in chain and "--loss" in chain and ".loss" in chain
    assert "not finite" not in chain and "non-finite" not in chain and "GRADIENTS" not in chain.upper()


@needs_chromium
def test_browser_crash_banner_at_the_top(browser, real):
    rep = real["reports"]["crash"]
    crash = rep.summary["crash"]
    _open(browser, real["pages"]["crash"])
    box = browser.eval("""(() => { const c = document.getElementById('crash'), v = document.getElementById('verdict');
        return {text: c.innerText, top: c.getBoundingClientRect().top, vtop: v.getBoundingClientRect().top,
                verdict: v.innerText}; })()""")
    assert 0 <= box["top"] < box["vtop"] < 900
    assert crash["type"] in box["text"] and crash["message"] in box["text"] and "crashed" in box["text"].lower()
    assert "Healthy" not in box["verdict"]


def test_report_cli_stderr_is_quiet(real, tmp_path):
    """`ampdoctor report` on a failing run writes nothing on stderr (no matplotlib warnings)."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "report", real["runs"]["nan"], "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert p.stderr == ""
    assert os.path.exists(tmp_path / "out" / "index.html")


def test_headroom_timeline_section(tmp_path):
    """A watched run with headroom=True shows the headroom timeline image; a short run with headroom=False the
    sentence, and a short default run (headroom="auto") a timeline again."""
    import ampdoctor
    from test_report_plots import _growing_run
    html = render_html(_growing_run())
    sec = html[html.index('id="headroom-timeline"'):]
    sec = sec[:sec.index("</section>")]
    assert "data:image/png;base64," in sec and "fc1" in sec
    html = render_html(ampdoctor.diagnose(rs.short_healthy_run(tmp_path / "run")))
    sec = html[html.index('id="headroom-timeline"'):]
    sec = sec[:sec.index("</section>")]
    assert 'class="empty"' in sec and "headroom=True" in sec and "<img" not in sec
    html = render_html(ampdoctor.diagnose(rs.short_healthy_run(tmp_path / "auto", headroom=None)))
    sec = html[html.index('id="headroom-timeline"'):]
    sec = sec[:sec.index("</section>")]
    assert "data:image/png;base64," in sec
