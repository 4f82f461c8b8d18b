"""Fifty-second set: REAL TRAINING CODE WHERE THE WATCHED MODEL'S OWN forward() IS NEVER CALLED (entry modules,
record/entries.py). Six fp16 failures that start mid-run at a known step (7-9: never a sampled step; full statistics
are taken on step 0 and every 200th) and three healthy twins, each written the way real code writes it: the watched
object is a container (a Lightning-style module, a seq2seq pair, a multi-task net, an EMA wrapper, a diffusion
pipeline, a backbone whose stem and blocks the loop chains itself) and the loop calls its submodules. Small models,
fixed seeds. Watched through the public API only (`ampdoctor.watch(model, optimizer=..., scaler=...,
run_dir=tmp_path / "run")` at the default settings) in this file's own loop (probe_harness.probe_run calls the root,
which these loops never do; its shape is kept): CPU fp16 autocast + `torch.amp.GradScaler("cpu")`, [inject under
no_grad] -> zero_grad -> (micro-batches:) autocast forward through the submodules -> scale(loss).backward ->
unscale_ -> clip_grad_norm_(1.0) -> step -> update -> [after: an EMA update / an eval] ; close -> `w.report()`.

Each failure is proven first by the test's own oracle: probe_harness.Producer on the WATCHED model (forward hooks on
every module, keyword inputs checked: the first module whose output is non-finite while its inputs and own
parameters were finite, at the expected step), the loss (first non-finite there), the scaler (it skips that step;
before it only the opening backoffs of steps 0-2), a float32 check (a fresh model with the weights the bad step's
forward ran with runs the bad step's batch through the same submodule calls in float32, no autocast: finite loss,
finite gradients) and the mechanism re-run on those weights under fp16 autocast (the producer's inputs finite, its
output not). A failing oracle is a plain failure. Only then must the rule be among the report's first three findings
at the PRODUCER (its name in the watched model's named_modules()), at that step, forward, an `error`, with no error
at the modules that only passed the inf/NaN on (the entry, the root, the producer's children, later modules); and
the bad step's capture must exist under run_dir/captures/ and its replay (`ampdoctor.replay(capture,
model=make())`, which runs the entry module the batch went into) must name the producer the same way. A wrong report
raises WrongAnswer naming ampdoctor's top three (rule@module op step phase [severity]).

 1. Lightning-style: `LitAudio.training_step(batch)` calls `self.model(**inputs)` on an HF-like audio classifier
    returning a ModelOutput-like dict with `.logits`, and its loss is a submodule (`self.criterion =
    nn.CrossEntropyLoss()`) called at top level. The classifier's `feature_extractor` computes a log-power spectrum
    through a DFT basis matmul (nnAudio / Whisper-style) in fp16. At step 8 a clip arrives as raw int16 PCM (not
    divided by 32768): the DFT coefficients and their square pass 65504 -> overflow at `model.feature_extractor`,
    step 8 (entry `model`).
 2. twin of 1: the collate divides the PCM by 32768 -> quiet, 24 steps, the loss falls.
 3. encoder-decoder (seq2seq forecasting): the loop calls `model.encoder(src)` then `model.decoder(tgt, memory)`.
    At the start of step 7 a resume callback restores the decoder's feed-forward input projection from a checkpoint
    saved in other units (x 1e5, a weight spike that stays): its output passes 65504 -> overflow at
    `decoder.layers.0.ff.fc1`, step 7 (entry `decoder`; every later step fails too).
 4. multi-task: `backbone` called once, `cls_head` and `depth_head` on its features; the depth head predicts log
    depth and returns exp(.) (Monodepth-style). At step 9 an HDR frame in linear radiance (values to 40) arrives
    instead of a [0, 1] sRGB image: the log depth passes 11.1 (about 25; exp of it finite in float32) and exp
    overflows fp16 -> overflow at `depth_head`, step 9 (entry `depth_head`; its Linear's output finite).
 5. EMA wrapper: `Wrapped(model, ema_model)`, only `model` trains; the EMA is updated under no_grad after every step
    and evaluated at top level under no_grad every third step. `model.pool` is a hand-written attention pooling,
    exp(s) / sum exp(s) without the max subtraction. At step 8 one sensor frame saturates (x 300): its score passes
    11.1, exp gives inf, inf / inf = NaN -> nan_origin (overflow accepted: the exp made the inf) at `model.pool`,
    step 8 (entry `model`).
 6. twin of 5: no glitch -> quiet, 24 steps (the EMA evals included), the loss falls.
 7. diffusion-style: `Pipe(text_encoder, unet)`, the text encoder frozen and called under no_grad, the unet trained;
    the loop applies prompt-emphasis weights to the text embeddings (float32, as prompt-weighting code does) and calls
    `pipe.unet(noisy, t, ctx)`. At step 8 a caption parses to an emphasis weight of 1e5 ("(token:100000)"): the
    cross-attention key projection's fp16 cast of that token passes 65504 -> overflow at `unet.attn.to_k`, step 8
    (entry `unet`; the text encoder, frozen and run without gradients, is no entry).
 8. the loop calls a submodule's submodules: `model.backbone.stem(x)` then `model.backbone.blocks(h)` then
    `model.head(h)`, with gradient accumulation over 2 micro-batches; the blocks' activation is Primer's squared ReLU
    (a module, in the working dtype). At step 7 the second micro-batch arrives in raw units (x 300): fc1's output
    (finite, a few hundred) squared passes 65504 -> overflow at `backbone.blocks.0.act`, step 7 (entries
    `backbone.stem`, `backbone.blocks`, `head`; the capture holds the `backbone.blocks` micro-batch).
 9. twin of 8: no raw batch -> quiet, 24 steps, the loss falls.
Twins also run unwatched: losses and final weights bitwise identical with and without the watch; no warning, no
error, no RuntimeWarning of ampdoctor's.

Not built (time): a multi-task net whose backbone is frozen for the first epochs (requires_grad_(False), unfrozen at
step 5, so on the sampled step 0 it held no trainable parameter and was no entry) with a GeM pooling failing in fp16:
after the unfreeze GeM's pow(1/3) backward overflowed on every step (mean of clamp(1e-4)^3 is 0 in fp16) before the
intended forward trigger; ampdoctor said `[error] overflow at backbone.4 step 5 backward` (GeM, right) with
`skipped_steps`. No clean mid-run forward trigger in the time.

Checked while writing (not asserted): with record/entries.py's adopt_entries switched off, five of the six reports
fall back to `nan_origin`/`overflow at (run)` and none of the six bad steps is captured, so these cases do exercise
the entry modules.

Result when written: 6/6 right; wrong: none. torch 2.13 CPU, what ampdoctor said:
1 `[error] overflow at model.feature_extractor aten::mm step 8` + `[error] skipped_steps (run) step 8`; capture entry
  `model`, replay `overflow at model.feature_extractor`;
3 `[error] overflow at decoder.layers.0.ff.fc1 aten::addmm step 7` + `[error] skipped_steps at
  decoder.layers.0.ff.fc1 step 7` (+ the opening backoff `[info] overflow at decoder.out step 0 backward`); entry
  `decoder`;
4 `[error] overflow at depth_head aten::exp step 9` + `[error] skipped_steps (run) step 9`; entry `depth_head`;
5 `[error] overflow at model.pool aten::exp step 8` (the exp that made the inf before inf / inf) + `[error]
  skipped_steps (run) step 8`; entry `model`;
7 `[error] overflow at unet.attn.to_k aten::_to_copy step 8` + `[error] skipped_steps (run) step 8`; entry `unet`;
8 `[error] overflow at backbone.blocks.0.act aten::pow step 7` + `[error] skipped_steps (run) step 7`; entry
  `backbone.blocks`.
Each replay of the bad step's capture named the same producer. Twins 2, 6, 9 quiet (no warning, no error, no
RuntimeWarning) and bitwise identical unwatched. Noticed (not asserted): in 3 skipped_steps is attributed to the
module `decoder.layers.0.ff.fc1` (elsewhere `(run)`).

Run: .venv/bin/python -m pytest -n 0 -q -p no:cacheprovider tests/test_unseen_variants52.py (about 6 s)
"""
from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, at_top3, finite, quiet_twin, real_fwd_after_backoffs as real_fwd
from scenarios import gen, no_error_at, one_thread

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FP16 = torch.float16
FWD = ("overflow", "nan_origin")


# ======================================================================================================================
# the loop, the oracle and the checks
# ======================================================================================================================
def loop(make, step_fn, batch, steps, run_dir, *, accum=1, inject=None, after=None, snap_at=None, lr=1e-3,
         watch=True):
    """The user's loop on a container whose forward is never called: `step_fn(m, *batch(i, k))` runs micro-batch k of
    step i through m's submodules (under fp16 autocast here) and returns its loss; AdamW over the trainable
    parameters, GradScaler("cpu"), [inject(i, m) under no_grad] -> zero_grad -> accum x (forward, scale(loss /
    accum).backward) -> unscale_ -> clip_grad_norm_(1.0) -> step -> update -> [after(i, m)]; ampdoctor.watch(m, ...)
    at the default settings and the Producer oracle on m (`watch=False`: neither). Returns the oracle's first
    producer, the steps with a non-finite loss, the skipped steps, the losses, the final weights, (snap_at) the state
    dict the forward of that step ran with, ampdoctor's RuntimeWarnings and the report."""
    torch.manual_seed(0)
    m = make()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    sc = torch.amp.GradScaler("cpu")
    orc = Producer(m, with_kwargs=True) if watch else None
    r = dict(skipped=[], bad_loss=[], losses=[], rep=None, warns=[], sd=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = ampdoctor.watch(m, optimizer=opt, scaler=sc, run_dir=run_dir) if watch else None
        for i in range(steps):
            if orc is not None:
                orc.step = i
            if inject is not None:
                with torch.no_grad():
                    inject(i, m)
            if i == snap_at:
                r["sd"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
            opt.zero_grad()
            tot = 0.0
            for k in range(accum):
                args = batch(i, k)
                with torch.autocast("cpu", dtype=FP16):
                    loss = step_fn(m, *args) / accum
                tot += loss.item()
                sc.scale(loss).backward()
            r["losses"].append(tot)
            if not math.isfinite(tot):
                r["bad_loss"].append(i)
            s0 = sc.get_scale()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            sc.step(opt)
            sc.update()
            if sc.get_scale() < s0:
                r["skipped"].append(i)
            if after is not None:
                after(i, m)
        if orc is not None:
            orc.remove()
        if w is not None:
            w.close()
            r["rep"] = w.report()
    r["warns"] = [str(x.message) for x in seen if issubclass(x.category, RuntimeWarning)
                  and str(x.message).startswith("ampdoctor:")]
    r["first"] = orc.first if orc is not None else None
    r["weights"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return r


def snapshot_model(make, r):
    """A fresh model with the weights (and buffers) the bad step's forward ran with."""
    torch.manual_seed(0)
    m = make()
    m.load_state_dict(r["sd"])
    return m


def f32(x):
    if torch.is_tensor(x) and x.is_floating_point():
        return x.float()
    if isinstance(x, dict):
        return {k: f32(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(f32(v) for v in x)
    return x


def fp32_finite(make, step_fn, r, batch, step, accum):
    """The bad step is an fp16 failure: its weights run its batch through the same calls in float32 (no autocast) to
    a finite loss with finite gradients."""
    m = snapshot_model(make, r)
    for k in range(accum):
        loss = step_fn(m, *f32(batch(step, k))) / accum
        assert math.isfinite(loss.item()), (step, k, loss.item())
        loss.backward()
    assert all(finite(p.grad) for p in m.parameters() if p.grad is not None), step


def fp16_calls(make, step_fn, r, batch, step, accum, name):
    """[(inputs, output)] of each call of module `name` when the bad step's batch is re-run under fp16 autocast on
    the weights that step ran with."""
    m = snapshot_model(make, r)
    seen = []
    h = dict(m.named_modules())[name].register_forward_hook(
        lambda mod, a, kw, o: seen.append((tuple(a) + tuple(kw.values()), o)), with_kwargs=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        for k in range(accum):
            step_fn(m, *batch(step, k))
    h.remove()
    return seen


def top3(rep):
    return [f"{f.rule}@{f.module if f.module is not None else '(run)'} {f.op} step {f.step} {f.phase} [{f.severity}]"
            for f in rep.findings[:3]]


def bad_capture(run_dir, step):
    """The capture the watch wrote of step `step`'s batch (CONTRACT: a step that first produces inf/NaN is captured
    under run_dir/captures/), or None."""
    for mf in sorted((run_dir / "captures").glob("*/manifest.json")):
        if json.loads(mf.read_text()).get("step") == step:
            return mf.parent
    return None


def named(r, rules, module, step, quiet_at=(), make=None, run_dir=None):
    """One of `rules` at the producer `module`, at `step`, forward, an error, among the first three findings, and no
    error at the modules that only passed it on; (make) the bad step's capture exists and its replay
    (`ampdoctor.replay(capture, model=make())`) names the producer the same way; else a WrongAnswer naming
    ampdoctor's top three."""
    rep = r["rep"]
    try:
        at_top3(rep, rules, module, step=step, phase="forward", severity="error")
        no_error_at(rep, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"top3={top3(rep)} warnings={r['warns']} ({str(e)[:800]})") from None
    if make is None:
        return
    cap = bad_capture(run_dir, step)
    if cap is None:
        raise WrongAnswer(f"no capture of step {step} under {run_dir / 'captures'}; top3={top3(rep)}")
    torch.manual_seed(0)
    rr = ampdoctor.replay(cap, model=make())
    try:
        at_top3(rr, rules, module, phase="forward", severity="error")
        no_error_at(rr, quiet_at)
    except AssertionError as e:
        raise WrongAnswer(f"replay of the step-{step} capture: top3={top3(rr)} ({str(e)[:800]})") from None


def check_failure(tmp_path, make, step_fn, batch, step, name, rules, quiet_at, *, accum=1, inject=None, after=None,
                  steps_after=5, lr=1e-3):
    """Oracle first (producer `name` at `step`, loss non-finite there, skipped; float32 finite; the producer's inputs
    finite and its output not under fp16), then the report."""
    r = loop(make, step_fn, batch, step + steps_after, tmp_path / "run", accum=accum, inject=inject, after=after,
             snap_at=step, lr=lr)
    real_fwd(r, name, step)
    fp32_finite(make, step_fn, r, batch, step, accum)
    calls = fp16_calls(make, step_fn, r, batch, step, accum, name)
    assert any(finite(a) and not finite(o) for a, o in calls), name
    named(r, rules, name, step, quiet_at=quiet_at, make=make, run_dir=tmp_path / "run")
    return r


def twin(tmp_path, make, step_fn, batch, steps, *, accum=1, after=None, lr=1e-3, fall=0.9):
    """A healthy twin: watched (with the oracle) and unwatched; healthy, ampdoctor quiet, and the watch changed
    nothing: losses and final weights bitwise identical."""
    r = loop(make, step_fn, batch, steps, tmp_path / "run", accum=accum, after=after, lr=lr)
    bare = loop(make, step_fn, batch, steps, tmp_path / "bare", accum=accum, after=after, lr=lr, watch=False)
    assert r["losses"] == bare["losses"], (r["losses"], bare["losses"])
    assert all(torch.equal(r["weights"][k], bare["weights"][k]) for k in r["weights"])
    ls = r["losses"]     # healthy (a plain failure otherwise): finite, falling, no producer, no skip after step 2
    assert all(map(math.isfinite, ls)) and r["first"] is None and sum(ls[-3:]) < fall * sum(ls[:3]), (r["first"], ls)
    assert [s for s in r["skipped"] if s >= 3] == [], r["skipped"]
    try:
        quiet_twin(r, fall=fall)
    except AssertionError as e:
        raise WrongAnswer(f"false alarm on a healthy run: top3={top3(r['rep'])} warnings={r['warns']} "
                          f"({str(e)[:800]})") from None
    return r


# ======================================================================================================================
# 1 + twin. Lightning-style module around an HF-like audio classifier: raw int16 PCM through an fp16 power spectrum
# ======================================================================================================================
FRAME, NBIN, T1, B1, PCM_AT = 32, 12, 10, 16, 8


class ModelOutput(dict):
    """transformers' ModelOutput, in short: a dict whose keys read as attributes."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class PowerSpectrum(nn.Module):
    """log |DFT|^2 of each frame through a fixed real DFT basis (a matmul, nnAudio / Whisper-style), in the frames'
    working dtype."""

    def __init__(self):
        super().__init__()
        n = torch.arange(FRAME).float()
        f = torch.arange(1, NBIN + 1).float()
        ang = 2 * math.pi * n[:, None] * f[None] / FRAME
        self.register_buffer("basis", torch.cat([ang.cos(), ang.sin()], 1))

    def forward(self, frames):
        spec = frames @ self.basis         # (fp16 under autocast)
        re, im = spec.chunk(2, -1)
        return torch.log(re * re + im * im + 1e-2)


class FF(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class AudioLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(d), FF(d, 2 * d)

    def forward(self, x):
        return x + self.ff(self.norm(x))


class AudioEncoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.layers = nn.ModuleList(AudioLayer(d) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TinyAudioClassifier(nn.Module):
    """An HF-like model: forward(input_values) -> ModelOutput(logits=...)."""

    def __init__(self, d=32, n_cls=4):
        super().__init__()
        self.feature_extractor = PowerSpectrum()
        self.feature_projection = nn.Linear(NBIN, d)
        self.encoder = AudioEncoder(d)
        self.classifier = nn.Linear(d, n_cls)

    def forward(self, input_values, attention_mask=None):
        frames = input_values.view(len(input_values), T1, FRAME)
        h = self.encoder(self.feature_projection(self.feature_extractor(frames)))
        return ModelOutput(logits=self.classifier(h.mean(1)))


class LitAudio(nn.Module):
    """A LightningModule without Lightning: training_step calls the inner model and the loss module."""

    def __init__(self):
        super().__init__()
        self.model = TinyAudioClassifier()
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, input_values):
        return self.model(input_values=input_values).logits

    def training_step(self, batch):
        inputs, labels = batch
        out = self.model(**inputs)
        return self.criterion(out.logits.float(), labels)


def lit_step(m, inputs, labels):
    return m.training_step((inputs, labels))


def pcm_batch(raw_at):
    """16 clips of 4 tones (the class) in noise, as float waveforms in [-1, 1]; at `raw_at` the clips arrive as raw
    int16 PCM values (the loader forgot / 32768)."""
    def batch(i, k):
        g = gen(1000 + i)
        y = torch.randint(0, 4, (B1,), generator=g)
        t = torch.arange(T1 * FRAME).float()
        freq = (y.float() * 2 + 2)[:, None]
        x = 0.5 * torch.sin(2 * math.pi * freq * t / FRAME) + 0.1 * torch.randn(B1, T1 * FRAME, generator=g)
        x = x.clamp(-1, 1)
        if i == raw_at:
            x = (x * 32767).round()
        return {"input_values": x}, y
    return batch


def test_lightning_hf_like_model_raw_pcm_power_spectrum_overflows(tmp_path):
    check_failure(tmp_path, LitAudio, lit_step, pcm_batch(PCM_AT), PCM_AT, "model.feature_extractor", FWD,
                  quiet_at=("model", "model.feature_projection", "model.encoder", "model.classifier", "criterion", ""))


def test_twin_lightning_hf_like_model_normalised_pcm_is_quiet(tmp_path):
    twin(tmp_path, LitAudio, lit_step, pcm_batch(-1), 24, lr=3e-3)


# ======================================================================================================================
# 3. encoder-decoder called separately: a weight spike in the decoder's feed-forward
# ======================================================================================================================
D3, L3, B3, SPIKE_AT, SPIKE_X = 32, 8, 16, 7, 1e5


class Attn(nn.Module):
    def __init__(self, d, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mem=None):
        mem = x if mem is None else mem
        B, T, D = x.shape

        def split(t):
            return t.view(B, -1, self.h, D // self.h).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(mem)), split(self.v(mem))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // self.h), -1)
        return self.o((a @ v).transpose(1, 2).reshape(B, T, D))


class EncLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n1, self.attn, self.n2, self.ff = nn.LayerNorm(d), Attn(d), nn.LayerNorm(d), FF(d, 4 * d)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.ff(self.n2(x))


class DecLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n1, self.self_attn = nn.LayerNorm(d), Attn(d)
        self.n2, self.cross_attn = nn.LayerNorm(d), Attn(d)
        self.n3, self.ff = nn.LayerNorm(d), FF(d, 4 * d)

    def forward(self, x, mem):
        x = x + self.self_attn(self.n1(x))
        x = x + self.cross_attn(self.n2(x), mem)
        return x + self.ff(self.n3(x))


class Encoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.pos = nn.Parameter(torch.randn(L3, d) * 0.02)
        self.layers = nn.ModuleList(EncLayer(d) for _ in range(2))
        self.norm = nn.LayerNorm(d)

    def forward(self, src):
        h = self.embed(src[..., None]) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class Decoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.pos = nn.Parameter(torch.randn(L3, d) * 0.02)
        self.layers = nn.ModuleList(DecLayer(d) for _ in range(2))
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, 1)

    def forward(self, tgt, memory):
        h = self.embed(tgt[..., None]) + self.pos
        for layer in self.layers:
            h = layer(h, memory)
        return self.out(self.norm(h)).squeeze(-1)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Encoder(D3), Decoder(D3)

    def forward(self, src, tgt):
        return self.decoder(tgt, self.encoder(src))


def s2s_step(m, src, tgt_in, tgt_out):
    memory = m.encoder(src)
    pred = m.decoder(tgt_in, memory)
    return F.mse_loss(pred.float(), tgt_out)


def s2s_batch(i, k):
    """Forecast the next 8 values of a noisy sine from the previous 8 (teacher forcing)."""
    g = gen(3000 + i)
    ph = torch.rand(B3, 1, generator=g) * 6.28
    t = torch.arange(2 * L3 + 1).float() * 0.4 + ph
    s = torch.sin(t) + 0.05 * torch.randn(B3, 2 * L3 + 1, generator=g)
    return s[:, :L3], s[:, L3:2 * L3], s[:, L3 + 1:]


def spike(at, name, factor):
    def inject(i, m):
        if i == at:
            dict(m.named_parameters())[name].mul_(factor)   # restored from a checkpoint saved in other units
    return inject


def test_encoder_decoder_called_separately_decoder_weight_spike(tmp_path):
    check_failure(tmp_path, Seq2Seq, s2s_step, s2s_batch, SPIKE_AT, "decoder.layers.0.ff.fc1", FWD,
                  inject=spike(SPIKE_AT, "decoder.layers.0.ff.fc1.weight", SPIKE_X),
                  quiet_at=("decoder", "decoder.layers.0", "decoder.layers.0.ff", "decoder.layers.0.ff.act",
                            "decoder.layers.0.ff.fc2", "decoder.layers.1", "decoder.out", "encoder", ""))


# ======================================================================================================================
# 4. multi-task: one backbone, two heads called on its features; exp of an unnormalised image's log depth
# ======================================================================================================================
B4, IMG_AT = 16, 9


class DepthHead(nn.Module):
    """Predicts log depth and returns depth = exp(log depth) (Monodepth-style)."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 1)

    def forward(self, f):
        return torch.exp(self.proj(f)).squeeze(-1)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls_head = nn.Linear(64, 5)
        self.depth_head = DepthHead(64)

    def forward(self, img):
        f = self.backbone(img)
        return self.cls_head(f), self.depth_head(f)


def mt_step(m, img, y, depth):
    feats = m.backbone(img)
    logits = m.cls_head(feats)
    pred = m.depth_head(feats)
    return F.cross_entropy(logits.float(), y) + F.l1_loss(pred.float(), depth)


def mt_batch(i, k):
    g = gen(4000 + i)
    img = torch.rand(B4, 3, 8, 8, generator=g)
    y = (img[:, 0].mean((1, 2)) * 10).long().clamp(0, 4)
    depth = 1 + 4 * img[:, 2].mean((1, 2))
    if i == IMG_AT:
        img = img * 40                 # an HDR frame in linear radiance (to 40), not a [0, 1] sRGB image
    return img, y, depth


def test_multitask_backbone_and_two_heads_depth_exp_overflows(tmp_path):
    check_failure(tmp_path, MultiTask, mt_step, mt_batch, IMG_AT, "depth_head", FWD,
                  quiet_at=("depth_head.proj", "backbone", "backbone.1", "backbone.3", "cls_head", ""))


# ======================================================================================================================
# 5 + twin. a wrapper with the model and its EMA: a hand-written attention pooling without the max subtraction
# ======================================================================================================================
C5, T5, B5, GLITCH_AT = 8, 12, 16, 8


class NaivePool(nn.Module):
    """Attention pooling over time, softmax written by hand: exp(s) / sum_t exp(s)."""

    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h):
        e = torch.exp(self.score(h))
        return (e / e.sum(1, keepdim=True) * h).sum(1)


class SensorNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.proj = nn.Linear(C5, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.pool = NaivePool(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.proj(x)
        h = h + self.mlp(h)
        return self.head(self.pool(h))


class Wrapped(nn.Module):
    """The model and its exponential moving average (timm ModelEmaV2-style); only `model` trains."""

    def __init__(self):
        super().__init__()
        self.model = SensorNet()
        self.ema_model = copy.deepcopy(self.model).requires_grad_(False)
        self.decay = 0.9

    def forward(self, x):
        return self.model(x)

    @torch.no_grad()
    def update_ema(self):
        for e, p in zip(self.ema_model.parameters(), self.model.parameters()):
            e.lerp_(p, 1 - self.decay)


P5 = torch.randn(3, C5, generator=gen(505))


def ema_batch(glitch_at):
    def batch(i, k):
        g = gen(5000 + i)
        y = torch.randint(0, 3, (B5,), generator=g)
        x = torch.randn(B5, T5, C5, generator=g) + P5[y][:, None]    # each activity's mean sensor pattern
        if i == glitch_at:
            x[3, 5] *= 300         # a sensor glitch: one saturated frame of one recording
        return x, y
    return batch


def ema_step(m, x, y):
    return F.cross_entropy(m.model(x).float(), y)


def ema_after(i, m):
    m.update_ema()
    if i % 3 == 2:                 # the validation loop: the EMA weights, no gradients
        with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
            m.ema_model(torch.randn(4, T5, C5, generator=gen(9000 + i)))


def test_ema_wrapper_naive_softmax_pool_nan(tmp_path):
    check_failure(tmp_path, Wrapped, ema_step, ema_batch(GLITCH_AT), GLITCH_AT, "model.pool", FWD, after=ema_after,
                  quiet_at=("model", "model.pool.score", "model.head", "ema_model", "ema_model.pool", ""))


def test_twin_ema_wrapper_clean_sensors_is_quiet(tmp_path):
    twin(tmp_path, Wrapped, ema_step, ema_batch(-1), 24, after=ema_after, lr=3e-3)


# ======================================================================================================================
# 7. diffusion-style pipeline: frozen text encoder under no_grad, the unet trained; a runaway prompt emphasis
# ======================================================================================================================
D7, V7, L7, B7, EMPH_AT = 32, 50, 6, 8, 8


class TextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V7, D7)
        self.fc = nn.Linear(D7, D7)
        self.norm = nn.LayerNorm(D7)

    def forward(self, ids):
        return self.norm(self.fc(self.tok(ids)))


class CrossAttn(nn.Module):
    def __init__(self, d, h=4):
        super().__init__()
        self.h = h
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, ctx):
        B, T, D = x.shape

        def split(t):
            return t.view(B, -1, self.h, D // self.h).transpose(1, 2)
        q, k, v = split(self.to_q(x)), split(self.to_k(ctx)), split(self.to_v(ctx))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // self.h), -1)
        return self.to_out((a @ v).transpose(1, 2).reshape(B, T, D))


class TinyUNet(nn.Module):
    def __init__(self, c=4, d=D7):
        super().__init__()
        self.conv_in = nn.Linear(c, d)
        self.time_mlp = nn.Sequential(nn.Linear(16, d), nn.SiLU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)
        self.attn = CrossAttn(d)
        self.ff = FF(d, 2 * d)
        self.conv_out = nn.Linear(d, c)

    def forward(self, x, t, ctx):
        freqs = torch.exp(-math.log(1000) * torch.arange(8).float() / 8)
        temb = t.float()[:, None] * freqs
        h = self.conv_in(x) + self.time_mlp(torch.cat([temb.sin(), temb.cos()], -1))[:, None]
        h = h + self.attn(self.norm(h), ctx)
        h = h + self.ff(h)
        return self.conv_out(h)


class Pipe(nn.Module):
    def __init__(self):
        super().__init__()
        self.text_encoder = TextEncoder().requires_grad_(False)
        self.unet = TinyUNet()

    def forward(self, x, t, ids):
        return self.unet(x, t, self.text_encoder(ids))


ALPHAS = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)


def diff_step(m, x0, ids, weights, t, noise):
    with torch.no_grad():
        ctx = m.text_encoder(ids)
    ctx = ctx.float() * weights[..., None]        # prompt emphasis, float32
    a = ALPHAS[t][:, None, None]
    noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
    pred = m.unet(noisy, t, ctx)
    return F.mse_loss(pred.float(), noise)


def diff_batch(i, k):
    g = gen(7000 + i)
    ids = torch.randint(0, V7, (B7, L7), generator=g)
    x0 = torch.randn(B7, 16, 4, generator=g) * 0.5 + (ids[:, :1, None].float() / V7)
    weights = torch.ones(B7, L7)
    if i == EMPH_AT:
        weights[2, 3] = 1e5       # "(token:100000)": a caption the emphasis parser took literally
    t = torch.randint(0, 1000, (B7,), generator=g)
    noise = torch.randn(B7, 16, 4, generator=g)
    return x0, ids, weights, t, noise


def test_diffusion_frozen_text_encoder_unet_emphasis_overflows(tmp_path):
    check_failure(tmp_path, Pipe, diff_step, diff_batch, EMPH_AT, "unet.attn.to_k", FWD,
                  quiet_at=("unet", "unet.attn", "unet.attn.to_out", "unet.ff", "unet.conv_out", "text_encoder", ""))


# ======================================================================================================================
# 8 + twin. the loop chains a submodule's submodules (stem, blocks, head) with gradient accumulation
# ======================================================================================================================
D8, B8, RAW_AT = 16, 16, 7


class ReLUSquared(nn.Module):
    """Primer's squared ReLU, relu(x) ** 2, in the working dtype."""

    def forward(self, x):
        return torch.relu(x) ** 2


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), ReLUSquared(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(D8, 32), nn.GELU())
        self.blocks = nn.Sequential(Block(32), Block(32))

    def forward(self, x):
        return self.blocks(self.stem(x))


class StemNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


W8 = torch.randn(D8, 4, generator=gen(808))


def stem_step(m, x, y):
    h = m.backbone.stem(x)
    h = m.backbone.blocks(h)
    return F.cross_entropy(m.head(h).float(), y)


def stem_batch(raw_at):
    def batch(i, k):
        g = gen(8000 + 2 * i + k)
        x = torch.randn(B8, D8, generator=g)
        y = (x @ W8).argmax(-1)
        if i == raw_at and k == 1:
            x = x * 300            # the second micro-batch in raw units (the scaler's transform skipped)
        return x, y
    return batch


def test_stem_blocks_head_called_directly_with_accumulation_overflows(tmp_path):
    check_failure(tmp_path, StemNet, stem_step, stem_batch(RAW_AT), RAW_AT, "backbone.blocks.0.act", FWD, accum=2,
                  quiet_at=("backbone.blocks", "backbone.blocks.0", "backbone.blocks.0.fc1", "backbone.blocks.0.fc2",
                            "backbone.blocks.1", "backbone.stem", "backbone", "head", ""))


def test_twin_stem_blocks_head_with_accumulation_is_quiet(tmp_path):
    twin(tmp_path, StemNet, stem_step, stem_batch(-1), 24, accum=2, lr=3e-3)
