"""Thirty-sixth set: FAILURES IN MODELS CALLED WITH THE ARGUMENT TYPES REAL CODE PASSES. Ten fp16 failures that start
mid-run at a known step (5-11: never a sampled step; full statistics are taken on step 0 and every 200th), in models
whose forward takes an Enum, a str-mixin Enum, a types.SimpleNamespace of options, a transformers.BatchEncoding
passed whole, a dict keyed by tuples, numpy arrays and a numpy scalar, a callable (the criterion), a frozen
dataclass of tensors and strings, a dict the forward mutates, and (10) the kinds a capture supports all in one call.
Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=..., run_dir=tmp_path / "run")`
at the default settings -> an ordinary CPU fp16 autocast + `torch.amp.GradScaler("cpu")` loop: scale(loss).backward
-> unscale_ -> clip_grad_norm_ -> step -> update -> close -> `w.report()`), ampdoctor's RuntimeWarnings recorded.

On such a step the per-layer view is the in-process replay of the step's capture (capture.py `_encode` writes the
call's args/kwargs as JSON + safetensors; replay/ re-runs it): where the capture cannot be written, or the replay
fails or runs another computation, the report can only say `... at (run)` ("a step without per-layer statistics").

Each failure is proven first by the test's own oracle (probe_harness.Producer with keyword inputs: the first module
whose output is non-finite while its inputs, keyword inputs and own parameters were finite, at the expected step),
plus the loss (first non-finite there) and the scaler (skips it; before it only the first steps' backoffs). Only
then must `overflow`/`nan_origin` be among the report's first three findings at the PRODUCER, at that step, forward,
error (and no error at the modules that only passed it on); a wrong report raises WrongAnswer naming ampdoctor's
top three (a failing oracle or a crash fails otherwise). The bad-input
standard: nothing the capture cannot hold may break training or the report (every run below goes to its end and
is reported), and watching must not change the training (6, 9 and 9's twin: the same losses, NaN for NaN, and the
same final weights as the loop without a watch). On the CPU autocast keeps layer_norm/softmax/exp in the input's
dtype: every producer is the autocast fp16 cast of an fp32 input inside a Linear/Conv (1-7, 9) or an fp16 addmm
(8, 10).

 1. Enum: a tabular model `forward(cat, num, stage: Stage)` (Stage.PRETRAIN every third step reconstructs the
    category, Stage.FINETUNE regresses); at step 7 a shard's duration column is in microseconds -> overflow at
    `num_proj`, step 7.
 2. str-mixin Enum (`class Task(str, Enum)`, dispatched with `task is Task.REG`): a multi-task model whose REG branch
    adds `price_proj(prices)`; at step 9 (a REG step) the prices come in cents, not millions of dollars ->
    overflow at `price_proj`, step 9.
 3. types.SimpleNamespace per-call options (`opts.pool`, `opts.temperature`): a microscopy patch classifier; at step
    8 a plate's 16-bit TIFFs go in as read (0..65535, saturated pixels 65535) -> overflow at `patch_embed`, step 8.
 4. transformers.BatchEncoding passed whole (`model(batch)`; input_ids, attention_mask, doc_stats): at step 10 one
    source's document length is in characters, not tens of thousands -> overflow at `num_proj`, step 10.
 5. a dict keyed by (sensor, view) tuples: a multi-camera model; at step 6 a drive's depth maps are the sensor's
    uint16 millimetres with invalid = 0xFFFF -> overflow at `enc.depth_front.0`, step 6.
 6. numpy: `forward(x, mean: np.ndarray, std: np.ndarray, dt: np.float32)` normalises inside the model with the
    dataset's statistics (kPa); at step 6 a station reports pressure in Pa -> overflow at `enc.0`, step 6.
 7. a callable argument: a keyword spotter `forward(spec, labels, criterion)` returning its own loss; at step 11 a
    shard holds power spectrograms of the int16 audio instead of log-mels -> overflow at `conv.0`, step 11.
 8. a frozen dataclass (`Utterance(feats, lengths, speaker: str, lang: str)`; `lang` picks an adapter): at step 5
    the German adapter is loaded from an int8 export without its per-tensor scales (the codes, |q| <= 127) ->
    overflow (addmm) at `adapters.de.2`, step 5 (and again at every later German step).
 9. a model that mutates the dict it receives (`labels = batch.pop("labels")`, returns its loss): an HDR image
    regressor; at step 8 a shard skips the tone mapping (the sun at 2e5 in linear radiance) -> overflow at `stem`,
    step 8.
10. the supported kinds together: int64 ids, a bool mask, fp16 features, a Python float temperature, a ragged list
    of tensors (padded inside), torch.Size, a None entry, a tuple nested five deep; at step 9 a depot exports its
    odometer features (kept in fp16) in metres, not km (6.0e4-6.4e4, finite in fp16) -> the fp16 addmm passes
    65504: overflow at `feat_proj.0`, step 9.
Twins (the data fixed; no warning, no error, no RuntimeWarning): 4 with the length in tens of thousands of
characters; 9 with the radiance tone-mapped.
Not built: a `slice`/`range` argument (the same `_encode` branch as 1, 3, 6, 7: "unsupported type"); a
BatchEncoding spread as `model(**batch)` (its kwargs are a plain dict of tensors, as 10's).

What ampdoctor says: all ten right (the producer at its step among the first three findings, an error), both twins
quiet, no RuntimeWarning. Nine of ten were wrong on 7be9157 (each test proved the failure first and failed only at
the report check):
- 1, 3, 4, 5, 6, 7: the capture was not written ("could not write a capture of step N (BadInput: cannot capture
  args[i]: unsupported type Stage / SimpleNamespace / BatchEncoding / ndarray / CrossEntropyLoss ...)", and for 5
  "dict key ('rgb', 'front') is not a str or int"): `[error] nan_origin at (run)` + `skipped_steps at (run)`; 1 and
  5 had NO overflow/nan_origin error at all (rules/origins.py added the "step without per-layer statistics"
  finding only before a located error, not when nothing was located).
- 2: the capture stored Task.REG as the plain str 'reg': the replay's `task is Task.REG` was False, it ran another
  head and put the NaN on "the loss computation outside the model".
- 8: a dataclass was read back as a dict ("'dict' object has no attribute 'feats'"): the module right at the next
  German step (7), the step wrong.
- 9: the watch kept a reference to the batch dict and the capture was written from the dict the forward had
  emptied ("KeyError: 'labels'").
Fixed: a watch's capture holds enums, SimpleNamespace, Mappings that are no dict (BatchEncoding), dict keys that are
tuples or enums, numpy arrays and scalars, dataclasses (read back as a dataclass of the same name and fields), and
writes anything else (a callable) as a placeholder naming its type; the in-process replay gives the model the live
objects it received where the capture cannot give them back exactly (capture.relive), with the capture's tensor
copies; the watch keeps the batch's containers as they were before the forward (tensors.shallow). A replay from disk of a capture holding a placeholder is one line,
exit 2 (tests/test_capture_objects.py); save_batch still refuses such an argument.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_unseen_variants36.py
"""
from __future__ import annotations

import enum
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from probe_harness import WrongAnswer, at_top3, probe_run, quiet_twin, real_fwd_after_backoffs as real_fwd
from scenarios import lines, no_error_at, one_thread, randn

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def gen(i):
    return torch.Generator().manual_seed(i)


def quiet(r):
    """A twin: healthy (the loss down by 10% at least) and ampdoctor quiet (probe_harness.quiet_twin)."""
    quiet_twin(r, fall=0.9)


def run(m, batch, loss_fn, steps, run_dir, *, inject=None, lr=1e-3, watch=True):
    """probe_harness.probe_run (the user's loop at the default settings; `watch=False`: the same loop, no watch and
    no oracle, for the losses-identical check) with a Producer on keyword inputs; `batch(i)` gives (args, kwargs,
    y)."""
    return probe_run(m, batch, loss_fn, steps, run_dir, inject=inject, lr=lr, watch=watch)


def named(r, rule, module, step, quiet_at=()):
    """The report check: `rule` at the producer, at its step, forward, error, among the first three findings (and
    no error at the modules that only passed it on). A failure is a WrongAnswer naming ampdoctor's top three and
    the RuntimeWarnings it gave."""
    rep = r["rep"]
    try:
        at_top3(rep, rule, module, step=step, phase="forward", severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={lines(rep)[:3]} warnings={r['warns']} ({e})") from None
    assert not [s for s in r["warns"] if "could not write a capture" in s or "replay" in s], r["warns"]


def same_training(a, b):
    """Watching did not change the training: the same losses (NaN for NaN) and the same final weights."""
    assert [repr(x) for x in a["losses"]] == [repr(x) for x in b["losses"]], (a["losses"], b["losses"])
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


def mse(out, y):
    return F.mse_loss(out.float(), y)


FWD = ("overflow", "nan_origin")
W8 = randn(8, seed=5)


# ======================================================================================================================
# 1. an Enum stage flag (a tabular model pretrained and fine-tuned in one loop)
# ======================================================================================================================
class Stage(enum.Enum):
    PRETRAIN = "pretrain"      # every third step: reconstruct the category from the numeric features
    FINETUNE = "finetune"


class TabNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.num_proj = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head, self.recon = nn.Linear(32, 1), nn.Linear(32, 10)

    def forward(self, cat, num, stage):
        if stage is Stage.PRETRAIN:
            return self.recon(self.body(torch.cat([torch.zeros_like(self.emb(cat)), self.num_proj(num)], -1)))
        return self.head(self.body(torch.cat([self.emb(cat), self.num_proj(num)], -1))).squeeze(-1)


US_AT = 7


def tab_batch(i):
    num = randn(32, 8, seed=100 + i)
    cat = torch.randint(0, 10, (32,), generator=gen(i))
    dur = 0.5 + 29.5 * torch.rand(32, generator=gen(50 + i))       # the duration column, in seconds
    y = (num @ W8).tanh() + dur / 30
    num[:, 2] = dur * (1e6 if i == US_AT else 1.0)                  # this shard logged it in microseconds
    stage = Stage.PRETRAIN if i % 3 == 0 else Stage.FINETUNE
    return (cat, num, stage), {}, (stage, cat, y)


def tab_loss(out, t):
    stage, cat, y = t
    return F.cross_entropy(out.float(), cat) if stage is Stage.PRETRAIN else mse(out, y)


def test_enum_stage_flag_duration_in_microseconds_overflows_num_proj(tmp_path):
    torch.manual_seed(0)
    r = run(TabNet(), tab_batch, tab_loss, US_AT + 3, tmp_path / "run")
    real_fwd(r, "num_proj", US_AT)
    named(r, FWD, "num_proj", US_AT, quiet_at=("body.0", "body.2", "head", ""))


# ======================================================================================================================
# 2. a str-mixin Enum task flag, dispatched with `is` (a multi-task model: classification / price regression)
# ======================================================================================================================
class Task(str, enum.Enum):
    CLS = "cls"
    REG = "reg"


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32))
        self.price_proj = nn.Linear(2, 32)
        self.cls_head, self.reg_head = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x, task, prices=None):
        h = self.trunk(x)
        if task is Task.REG:
            return self.reg_head(F.gelu(h + self.price_proj(prices))).squeeze(-1)
        return self.cls_head(h)


CENTS_AT = 9


def task_batch(i):
    x = randn(32, 8, seed=100 + i)
    if i % 2 == 0:
        return (x, Task.CLS), {}, (Task.CLS, (x @ W8 > 0).long() + 2 * (x[:, 0] > 0).long())
    prices = 0.05 + 0.45 * torch.rand(32, 2, generator=gen(i))      # listing prices, in millions of dollars
    y = (x @ W8).tanh() + 2 * prices[:, 0]
    if i == CENTS_AT:                                                # this feed sent them in cents
        prices = prices * 1e8
    return (x, Task.REG), {"prices": prices}, (Task.REG, y)


def task_loss(out, t):
    return F.cross_entropy(out.float(), t[1]) if t[0] is Task.CLS else mse(out, t[1])


def test_str_enum_task_flag_prices_in_cents_overflow_price_proj(tmp_path):
    torch.manual_seed(0)
    r = run(MultiTask(), task_batch, task_loss, CENTS_AT + 3, tmp_path / "run")
    real_fwd(r, "price_proj", CENTS_AT)
    named(r, FWD, "price_proj", CENTS_AT, quiet_at=("reg_head", "trunk.2", ""))


# ======================================================================================================================
# 3. per-call options as a types.SimpleNamespace (a microscopy patch classifier)
# ======================================================================================================================
class PatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, 32, 4, stride=4)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 3)

    def forward(self, img, opts):
        h = self.patch_embed(img).flatten(2).transpose(1, 2)        # (B, 16 patches, 32)
        h = h + self.mlp(h)
        if opts.pool == "mean":
            h = h.mean(1)
        else:
            h = h.amax(1)
        return self.head(h) / opts.temperature


TIFF_AT = 8


def micro_batch(i):
    g = gen(i)
    img = (torch.rand(16, 1, 16, 16, generator=g) * 0.6 + 0.3 * torch.randn(16, 1, 1, 1, generator=g)).clamp(0, 1)
    y = (img.mean((1, 2, 3)) * 6).long().clamp(0, 2)
    if i == TIFF_AT:                 # this plate's 16-bit TIFFs went in as read (0..65535): saturated pixels 65535
        img = (img * 65535).round()
    return (img, types.SimpleNamespace(pool="mean", temperature=1.0, drop_path=0.0)), {}, y


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def test_simplenamespace_options_16bit_tiff_overflows_patch_embed(tmp_path):
    torch.manual_seed(0)
    r = run(PatchNet(), micro_batch, ce, TIFF_AT + 3, tmp_path / "run")
    real_fwd(r, "patch_embed", TIFF_AT)
    named(r, FWD, "patch_embed", TIFF_AT, quiet_at=("mlp.0", "mlp.2", "head", ""))


# ======================================================================================================================
# 4 + twin. a transformers.BatchEncoding passed whole (a text + numeric-feature classifier)
# ======================================================================================================================
class DocClassifier(nn.Module):
    def __init__(self, vocab=100):
        super().__init__()
        self.tok = nn.Embedding(vocab, 32)
        self.num_proj = nn.Linear(3, 32)
        self.mix = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 2)

    def forward(self, batch):
        mask = batch["attention_mask"].unsqueeze(-1).float()
        text = (self.tok(batch["input_ids"]) * mask).sum(1) / mask.sum(1)
        return self.head(self.mix(torch.cat([text, self.num_proj(batch["doc_stats"])], -1)))


CHARS_AT = 10


def doc_batch(fixed):
    from transformers import BatchEncoding

    def batch(i):
        g = gen(i)
        ids = torch.randint(1, 100, (16, 12), generator=g)
        lens = torch.randint(4, 13, (16,), generator=g)
        mask = (torch.arange(12)[None] < lens[:, None]).long()
        ids = ids * mask
        stats = torch.rand(16, 3, generator=g) * torch.tensor([8.0, 1.0, 1.0])   # 10k-chars, ratio, paragraphs/10
        y = ((ids == 3).any(1) | (stats[:, 0] > 4)).long()
        if i == CHARS_AT and not fixed:     # this source's length column is in characters, not tens of thousands
            stats[:, 0] *= 1e4
        return (BatchEncoding({"input_ids": ids, "attention_mask": mask, "doc_stats": stats}),), {}, y
    return batch


def test_batchencoding_passed_whole_doc_length_in_chars_overflows_num_proj(tmp_path):
    torch.manual_seed(0)
    r = run(DocClassifier(), doc_batch(False), ce, CHARS_AT + 3, tmp_path / "run")
    real_fwd(r, "num_proj", CHARS_AT)
    named(r, FWD, "num_proj", CHARS_AT, quiet_at=("mix.0", "head", ""))


def test_twin_batchencoding_doc_length_in_thousands_is_quiet(tmp_path):
    torch.manual_seed(0)
    quiet(run(DocClassifier(), doc_batch(True), ce, CHARS_AT + 3, tmp_path / "run", lr=3e-3))


# ======================================================================================================================
# 5. a dict of tensors keyed by tuples (a multi-camera model: {(sensor, view): frames})
# ======================================================================================================================
class MultiCam(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleDict({
            "rgb_front": nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1)),
            "depth_front": nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))})
        self.fuse = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, views):
        feats = [self.enc[f"{sensor}_{view}"](t).flatten(1) for (sensor, view), t in sorted(views.items())]
        return self.head(F.gelu(self.fuse(torch.cat(feats, -1)))).squeeze(-1)


MM_AT = 6


def cam_batch(i):
    g = gen(i)
    rgb = torch.rand(8, 3, 12, 12, generator=g)
    depth = 0.5 + 9.5 * torch.rand(8, 1, 12, 12, generator=g)       # metres; invalid pixels 0
    invalid = torch.rand(8, 1, 12, 12, generator=g) < 0.05
    y = depth.mean((1, 2, 3)) / 5 - rgb.mean((1, 2, 3))
    if i == MM_AT:     # this drive's depth maps are the sensor's uint16 millimetres, invalid = 0xFFFF
        depth = (depth * 1000).round().masked_fill(invalid, 65535.0)
    else:
        depth = depth.masked_fill(invalid, 0.0)
    return ({("rgb", "front"): rgb, ("depth", "front"): depth},), {}, y


def test_tuple_keyed_views_depth_in_uint16_mm_overflows_depth_encoder(tmp_path):
    torch.manual_seed(0)
    r = run(MultiCam(), cam_batch, mse, MM_AT + 3, tmp_path / "run")
    real_fwd(r, "enc.depth_front.0", MM_AT)
    named(r, FWD, "enc.depth_front.0", MM_AT, quiet_at=("fuse", "head", "enc.rgb_front.0", ""))


# ======================================================================================================================
# 6. numpy normalisation statistics (np.ndarray) and a numpy scalar time step (np.float32) beside a tensor
# ======================================================================================================================
class WeatherNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 1)

    def forward(self, x, mean, std, dt):
        x = (x - torch.as_tensor(mean, dtype=x.dtype)) / torch.as_tensor(std, dtype=x.dtype)
        return self.head(self.enc(x)).squeeze(-1) * float(dt)


STATS_MEAN = np.array([101.3, 15.0, 60.0, 5.0], dtype=np.float32)     # kPa, degC, %RH, m/s
STATS_STD = np.array([1.2, 8.0, 20.0, 3.0], dtype=np.float32)
PA_AT = 6


def weather_batch(i):
    z = randn(32, 4, seed=100 + i)
    x = torch.from_numpy(STATS_MEAN) + z * torch.from_numpy(STATS_STD)
    y = (z @ W8[:4]).tanh()
    if i == PA_AT:                    # this station reports pressure in Pa; the statistics are in kPa
        x[:, 0] *= 1000
    return (x, STATS_MEAN, STATS_STD, np.float32(0.5)), {}, y * 0.5


def test_numpy_stats_and_scalar_pressure_in_pa_overflows_first_linear(tmp_path):
    torch.manual_seed(0)
    r = run(WeatherNet(), weather_batch, mse, PA_AT + 3, tmp_path / "run")
    real_fwd(r, "enc.0", PA_AT)
    torch.manual_seed(0)
    same_training(r, run(WeatherNet(), weather_batch, mse, PA_AT + 3, tmp_path / "plain", watch=False))
    named(r, FWD, "enc.0", PA_AT, quiet_at=("enc.2", "head", ""))


# ======================================================================================================================
# 7. a callable passed into forward (the criterion: the model returns its own loss)
# ======================================================================================================================
class KeywordSpotter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(16, 32, 5, padding=2), nn.GELU(), nn.Conv1d(32, 32, 3, padding=1))
        self.head = nn.Linear(32, 5)

    def forward(self, spec, labels, criterion):
        logits = self.head(F.gelu(self.conv(spec)).mean(-1))
        return criterion(logits.float(), labels)


POWER_AT = 11


def kws_batch(i):
    g = gen(i)
    labels = torch.randint(0, 5, (16,), generator=g)
    logmel = torch.randn(16, 16, 40, generator=g) + 0.8 * F.one_hot(labels, 16).float()[:, :, None]
    if i == POWER_AT:     # this shard kept the power spectrogram of the int16 audio instead of its log-mel
        spec = torch.exp(logmel * 2 + 18)
    else:
        spec = logmel
    return (spec, labels, nn.CrossEntropyLoss(label_smoothing=0.1)), {}, None


def own_loss(out, y):
    return out


def test_callable_criterion_power_spectrogram_overflows_first_conv(tmp_path):
    torch.manual_seed(0)
    r = run(KeywordSpotter(), kws_batch, own_loss, POWER_AT + 3, tmp_path / "run")
    real_fwd(r, "conv.0", POWER_AT)
    named(r, FWD, "conv.0", POWER_AT, quiet_at=("conv.2", "head", ""))


# ======================================================================================================================
# 8. a frozen dataclass holding tensors and strings (an utterance with its speaker and language: language adapters)
# ======================================================================================================================
@dataclass(frozen=True)
class Utterance:
    feats: torch.Tensor
    lengths: torch.Tensor
    speaker: str
    lang: str


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.adapters = nn.ModuleDict({k: nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 32))
                                       for k in ("en", "de")})
        self.head = nn.Linear(32, 1)

    def forward(self, u):
        h = self.norm(self.inp(u.feats))
        h = h + self.adapters[u.lang](h)
        mask = (torch.arange(h.shape[1])[None] < u.lengths[:, None]).unsqueeze(-1)
        return self.head((h * mask).sum(1) / u.lengths[:, None]).squeeze(-1)


CODES_AT = 5


def utt_batch(i):
    g = gen(i)
    feats = torch.randn(8, 10, 8, generator=g)
    lengths = torch.randint(3, 11, (8,), generator=g)
    y = (feats.mean(1) @ W8).tanh()
    return (Utterance(feats, lengths, speaker=f"spk{i % 4}", lang="de" if i % 2 else "en"),), {}, y


def load_de_adapter(i, m):
    if i != CODES_AT:
        return
    for lin, seed in ((m.adapters["de"][0], 7), (m.adapters["de"][2], 8)):
        trained = randn(*lin.weight.shape, seed=seed) * 0.05
        scale = trained.abs().max() / 127
        lin.weight.copy_((trained / scale).round())    # the int8 export's codes, loaded without their scales


def test_frozen_dataclass_int8_adapter_codes_overflow_the_adapter_up_projection(tmp_path):
    torch.manual_seed(0)
    r = run(Adapted(), utt_batch, mse, CODES_AT + 3, tmp_path / "run", inject=load_de_adapter)
    real_fwd(r, "adapters.de.2", CODES_AT)
    named(r, FWD, "adapters.de.2", CODES_AT, quiet_at=("adapters.de.0", "head", ""))


# ======================================================================================================================
# 9 + twin. a model that pops its labels out of the dict it receives (an HDR image regressor)
# ======================================================================================================================
class HDRNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.body = nn.Sequential(nn.GELU(), nn.Conv2d(16, 16, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 1)

    def forward(self, batch):
        labels = batch.pop("labels")          # the rest of the batch is the model's input
        pred = self.head(self.body(self.stem(batch["pixel_values"])).flatten(1)).squeeze(-1)
        return F.mse_loss(pred.float(), labels)


HDR_AT = 8


def hdr_batch(tonemapped):
    def batch(i):
        g = gen(i)
        radiance = torch.rand(8, 3, 16, 16, generator=g) * 2
        radiance[:, :, 2:4, 2:4] = 2e5                                  # the sun, in linear radiance
        ldr = radiance / (1 + radiance)                                 # Reinhard tone mapping
        y = ldr.mean((1, 2, 3))
        px = radiance if i == HDR_AT and not tonemapped else ldr        # this shard skipped the tone mapping
        return ({"pixel_values": px, "labels": y},), {}, None
    return batch


def test_dict_mutating_model_hdr_radiance_overflows_the_stem(tmp_path):
    torch.manual_seed(0)
    r = run(HDRNet(), hdr_batch(False), own_loss, HDR_AT + 3, tmp_path / "run")
    real_fwd(r, "stem", HDR_AT)
    torch.manual_seed(0)
    same_training(r, run(HDRNet(), hdr_batch(False), own_loss, HDR_AT + 3, tmp_path / "plain", watch=False))
    named(r, FWD, "stem", HDR_AT, quiet_at=("body.1", "head", ""))


def test_twin_dict_mutating_model_tonemapped_is_quiet(tmp_path):
    torch.manual_seed(0)
    r = run(HDRNet(), hdr_batch(True), own_loss, HDR_AT + 3, tmp_path / "run", lr=3e-3)
    quiet(r)
    torch.manual_seed(0)
    same_training(r, run(HDRNet(), hdr_batch(True), own_loss, HDR_AT + 3, tmp_path / "plain", lr=3e-3,
                         watch=False))


# ======================================================================================================================
# 10. the supported kinds together: int64 ids, a bool mask, fp16 features, a Python float temperature, a ragged
#     list of tensors, torch.Size, None entries, a tuple nested five deep
# ======================================================================================================================
class FleetModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.feat_proj = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
        self.seg_proj = nn.Linear(6, 32)
        self.mix = nn.Sequential(nn.Linear(96, 64), nn.GELU())
        self.head = nn.Linear(64, 6)

    def forward(self, ids, mask, feats, segments, *, temperature, out_shape, prior=None, levels=None):
        m = mask.unsqueeze(-1).to(self.tok.weight.dtype)
        text = (self.tok(ids) * m).sum(1) / m.sum(1).clamp_min(1)
        seg = self.seg_proj(pad_sequence(segments, batch_first=True)).mean(1)
        h = self.mix(torch.cat([text, self.feat_proj(feats), seg], -1))
        if prior is not None:
            h = h + prior
        w = 1.0
        while levels is not None:              # per-level weights of a hierarchical label: (w, (w, (w, ...)))
            w = w * levels[0]
            levels = levels[1] if len(levels) > 1 else None
        return (self.head(h) * w / temperature).view(out_shape)


KM_AT = 9


def fleet_batch(i):
    g = gen(i)
    ids = torch.randint(0, 50, (16, 10), generator=g)
    mask = torch.rand(16, 10, generator=g) < 0.8
    odo = 60 + 4 * torch.rand(16, 64, generator=g)                     # odometer readings, km
    if i == KM_AT:                                                     # this depot's export: metres
        odo = odo * 1000
    feats = odo.half()                                                 # the feature store keeps fp16
    segments = [torch.randn(int(n), 6, generator=g) for n in torch.randint(2, 9, (16,), generator=g)]
    y = (ids.float().mean(1, keepdim=True) / 25 - 1).expand(16, 6).reshape(16, 2, 3)
    levels = (torch.tensor(1.0), (torch.tensor(0.9), (torch.tensor(1.1), (torch.tensor(1.0), (torch.tensor(1.0),)))))
    return (ids, mask, feats, segments), dict(temperature=0.7, out_shape=torch.Size([16, 2, 3]), prior=None,
                                             levels=levels), y


def test_mixed_supported_kinds_fp16_odometer_in_metres_overflows_feat_proj(tmp_path):
    torch.manual_seed(0)
    r = run(FleetModel(), fleet_batch, mse, KM_AT + 3, tmp_path / "run")
    real_fwd(r, "feat_proj.0", KM_AT)
    assert bool(torch.isfinite(fleet_batch(KM_AT)[0][2]).all())       # the fp16 features themselves are finite
    named(r, FWD, "feat_proj.0", KM_AT, quiet_at=("feat_proj.1", "mix.0", "head", ""))
