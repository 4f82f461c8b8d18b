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
