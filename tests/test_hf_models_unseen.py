"""Real Hugging Face model classes not trained by the earlier probes, under ampdoctor.watch at its DEFAULT settings.

Tiny configs built locally (`Config(...)` then `Model(config)`, no download), CPU, fixed seeds, one loop (`fit`):
[inject(k, model) under no_grad] -> zero_grad -> autocast forward (fp16, or bf16 where said) -> loss ->
fp16: scaler.scale(loss).backward() -> unscale_ -> clip_grad_norm_(1.0) -> scaler.step -> update (a real
`torch.amp.GradScaler("cpu")`); bf16: backward -> clip -> step (no scaler, as bf16 is trained). AdamW.

Healthy (a): the UNWATCHED twin carries the oracle (probe_harness.Producer: no module makes inf/NaN from finite
inputs; every loss finite; the mean of the last third below the first third's; no skip after the scaler's opening
search of at most 4); the WATCHED run (same seeds; ALBERT with dropout 0.1, so the RNG stream counts too) must
train bitwise identically (every loss and every final weight/buffer) and its report must hold no warning and no
error (exit code 0).
 1. albert_shared_layers_fp16: AlbertForMaskedLM, 3 layers from ONE shared layer group (its modules run 3 times a
    step, their parameters get 3 gradient contributions), factorised embedding (16 -> 32), MLM decoder tied to the
    word embedding;
 2. qwen2moe_router_aux_fp16: Qwen2MoeForCausalLM, 4 fused experts top-2 + a sigmoid-gated shared expert, the
    router's load-balancing aux loss in out.loss (output_router_logits=True), on a bigram "language";
 3. cohere_tied_logit_scale_bf16: CohereForCausalLM (parallel attention/MLP block, bias-free LayerNorm, tied
    embeddings, logit_scale), bf16 autocast, no scaler;
 4. deit_distillation_heads_bf16: DeiTForImageClassificationWithTeacher (cls + distillation tokens), DeiT's hard
    distillation loss CE(cls, y) + CE(dist, teacher_y) on both heads, bf16.
Injected (b): each failure proven first by the oracle (Producer, keyword inputs checked, own parameters not required
finite: the module + step where the first inf/NaN is made from finite inputs), the loss non-finite and the scaler
skipping at that step; then the report must hold the rule at that module and step among its first three
warning/error findings (an error for overflow / nan_origin).
 5. albert_shared_ffn_overflow: the SHARED `albert.encoder.albert_layer_groups.0.albert_layers.0.ffn` weight x3e5 at
    step 6 (its first of three calls that step overflows) -> overflow there, step 6;
 6. gptneox_qkv_overflow: GPTNeoXForCausalLM, `gpt_neox.layers.1.attention.query_key_value` x3e5 at step 5;
 7. qwen2moe_shared_expert_overflow: `model.layers.0.mlp.shared_expert.up_proj` x3e5 at step 7 (the MoE block's
    fused experts and router stay finite until it);
 7b. qwen2moe_fused_expert_overflow: not a Linear: expert 2 of the fused 3-D `gate_up_proj` of
    `model.layers.1.mlp.experts` (Qwen2MoeExperts with the "eager" experts implementation: F.linear on a slice per
    routed expert, fp16 under autocast) x3e5 at step 6 -> overflow at `model.layers.1.mlp.experts`, step 6. (With
    transformers' default "grouped_mm" the experts run in fp32 on CPU: the same injection makes no inf at all.)
 8. distilbert_ffn_overflow: DistilBertForMaskedLM, `distilbert.transformer.layer.1.ffn.lin1` x3e5 at step 4;
 9. deit_intermediate_overflow: DeiTForImageClassification, `deit.layers.0.mlp.fc1` x3e5 at step 8;
10. mask_f32min_in_fp16: a left-padding LM wrapper around Phi3ForCausalLM (eager attention) whose `mask` submodule
    builds the 4D causal + padding mask by hand in fp16 with torch.finfo(torch.float32).min (-inf in fp16 from step
    0, the oracle's producer: `mask`, step 0); at step 5 the first left-padded batch: the pad query rows are all -inf,
    softmax NaN, the scaler skips -> mask_value_overflow at `mask` (step 0, where the constant became -inf, or 5,
    where it broke training);
11. layernorm_eps_1e12_fp16: a sensor encoder (bias-free Linear -> a hand-written LayerNorm with eps=1e-12 computing
    in its input's dtype -> ElectraModel via inputs_embeds -> head); at step 6 a batch with dropped (all-zero)
    frames: var = 0 and x - mean = 0, eps is 0 in fp16, 0/0 = NaN in `norm` (the oracle's producer) ->
    eps_underflow (or nan_origin, the producer rule) at `norm`, step 6.

What ampdoctor said (all right): 5-9 overflow (error) at the injected module and step, aten::addmm/mm, first
finding, with skipped_steps at the same module second; 10 mask_value_overflow at `mask` aten::mul step 5 (error,
first), then overflow at `mask` step 5; 11 eps_underflow at `norm` aten::add step 6 (error, first), then nan_origin
at `norm` aten::div step 6; 1-4 quiet (no warning/error) and bitwise identical to the unwatched twin.

Result when written: 12 pass, 0 xfail (no wrong answer found; a wrong one would raise WrongAnswer for a strict
probe_harness.wrong xfail).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from probe_harness import Producer, WrongAnswer, finite
from scenarios import alarms, lines, one_thread

transformers = pytest.importorskip("transformers")

one_thread_fixture = pytest.fixture(autouse=True)(one_thread)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 128


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------ data
def bigram_ids(k, b=8, t=16, cycle=4):
    """A deterministic bigram 'language': x[t+1] = (5 x[t] + 7) % V (tokens 4..V-1), random starts."""
    g = gen(k % cycle)
    x = torch.randint(4, V, (b, 1), generator=g)
    cols = [x]
    for _ in range(t - 1):
        cols.append((cols[-1] * 5 + 7) % (V - 4) + 4)
    return torch.cat(cols, 1)


def lm_batch(k):
    ids = bigram_ids(k)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())


def mlm_batch(mask_id):
    def batch(k):
        ids = bigram_ids(k)
        pick = torch.rand(ids.shape, generator=gen(100 + k % 4)) < 0.2
        pick[:, 0] = True
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
        return dict(input_ids=torch.where(pick, torch.full_like(ids, mask_id), ids),
                    attention_mask=torch.ones_like(ids), labels=labels)
    return batch


PATTERNS = torch.randn(5, 3, 16, 16, generator=gen(77))


def img(k, b=8):
    y = torch.randint(0, 5, (b,), generator=gen(200 + k % 4))
    x = PATTERNS[y] + 0.5 * torch.randn(b, 3, 16, 16, generator=gen(300 + k % 4))
    return x, y


# ------------------------------------------------------------------------------------------------------------ loop
def fit(model, batch, steps, *, dtype=torch.float16, watch=True, oracle=None, inject=None, loss_fn=None, lr=1e-3):
    """The user's loop (module docstring); returns a dict: report (None unwatched), losses, skipped, first (the
    oracle's producer), state (the final state_dict)."""
    torch.manual_seed(1234)                      # dropout's RNG: the same in the watched run and its twin
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sc = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    prod = Producer(model, own_params=False, with_kwargs=True) if oracle else None
    w = ampdoctor.watch(model, optimizer=opt, scaler=sc) if watch else None
    losses, skipped = [], []
    try:
        for k in range(steps):
            if prod is not None:
                prod.new_step(k)
            if inject is not None:
                with torch.no_grad():
                    inject(k, model)
            b = batch(k)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                out = model(**b) if loss_fn is None else loss_fn(model, b)
            loss = out.loss if loss_fn is None else out
            if sc is not None:
                s0 = sc.get_scale()
                sc.scale(loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
                if sc.get_scale() < s0:
                    skipped.append(k)
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            losses.append(loss.item())
    finally:
        if prod is not None:
            prod.remove()
        if w is not None:
            w.close()
    return dict(rep=w.report() if w is not None else None, losses=losses, skipped=skipped,
                first=prod.first if prod is not None else None,
                state={n: v.detach().clone() for n, v in model.state_dict().items()})


def healthy_case(build, batch, steps=20, dtype=torch.float16, loss_fn=None, lr=5e-3):
    """(a): the unwatched twin is healthy (oracle), the watched run identical to it and quiet."""
    twin = fit(build(), batch, steps, dtype=dtype, watch=False, oracle=True, loss_fn=loss_fn, lr=lr)
    ls = twin["losses"]
    assert all(map(math.isfinite, ls)), ls
    n = len(ls) // 3
    assert sum(ls[-n:]) / n < 0.95 * sum(ls[:n]) / n, ls
    assert twin["first"] is None, twin["first"]
    assert all(s < 4 for s in twin["skipped"]) and len(twin["skipped"]) <= 4, twin["skipped"]
    assert all(bool(torch.isfinite(v).all()) for v in twin["state"].values() if v.is_floating_point())
    r = fit(build(), batch, steps, dtype=dtype, watch=True, loss_fn=loss_fn, lr=lr)
    diff = [k for k, (a, b) in enumerate(zip(ls, r["losses"])) if not (a == b or a != a and b != b)]
    if diff or len(ls) != len(r["losses"]):
        raise WrongAnswer(f"watched losses differ from the unwatched twin's at steps {diff}")
    bad = [n for n, v in twin["state"].items() if not torch.equal(v, r["state"][n])]
    if bad:
        raise WrongAnswer(f"watched final weights differ: {bad[:5]}")
    if r["skipped"] != twin["skipped"]:
        raise WrongAnswer(f"skips differ: {r['skipped']} vs {twin['skipped']}")
    rep = r["rep"]
    if alarms(rep.findings) or rep.exit_code != 0:
        raise WrongAnswer(f"false alarm on a healthy run: {alarms(rep.findings)}")
    return r


def top3_alarms(rep):
    return [f for f in rep.findings if f.severity in ("warning", "error")][:3]


def expect_at(rep, rules, module, steps, severity=("error",)):
    """One of `rules` at `module`, at one of `steps`, with `severity`, among the first three warning/error findings;
    else WrongAnswer naming what ampdoctor said."""
    rules = (rules,) if isinstance(rules, str) else rules
    top = top3_alarms(rep)
    hit = [f for f in top if f.rule in rules and f.module == module and f.step in steps and f.severity in severity]
    if not hit:
        raise WrongAnswer(f"want {rules} at {module!r} step {steps}; top3: {[f.one_line() for f in top]}; "
                          f"all: {lines(rep)[:6]}")
    return hit[0]


def scale_weight(name, step, factor=3e5):
    def inject(k, model):
        if k == step:
            model.get_submodule(name).weight.mul_(factor)
    return inject


def real_fail(r, module, step):
    """The oracle: the first producer is `module` at `step`, the loss first non-finite there (or the scaler skips
    it), no skip after the opening search before it."""
    assert r["first"] == (module, step), r["first"]
    bad = [k for k, v in enumerate(r["losses"]) if not math.isfinite(v)]
    assert (bad and bad[0] == step) or step in r["skipped"], (r["losses"], r["skipped"])
    assert step in r["skipped"] and all(s < 4 for s in r["skipped"] if s < step), r["skipped"]


# ---------------------------------------------------------------------------------------------------------- models
def albert():
    torch.manual_seed(0)
    c = transformers.AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                  num_hidden_groups=1, num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64, hidden_dropout_prob=0.1,
                                  attention_probs_dropout_prob=0.1, pad_token_id=0)
    m = transformers.AlbertForMaskedLM(c)
    assert m.predictions.decoder.weight is m.albert.embeddings.word_embeddings.weight
    return m


def qwen2moe(experts=None):
    torch.manual_seed(0)
    c = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02,
                                    decoder_sparse_step=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if experts is not None:
        c._experts_implementation = experts
    return transformers.Qwen2MoeForCausalLM(c)


def cohere():
    torch.manual_seed(0)
    c = transformers.CohereConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    m = transformers.CohereForCausalLM(c)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def deit_cfg():
    return transformers.DeiTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64, num_labels=5)


def deit_teacher():
    torch.manual_seed(0)
    return transformers.DeiTForImageClassificationWithTeacher(deit_cfg())


def deit_cls():
    torch.manual_seed(0)
    return transformers.DeiTForImageClassification(deit_cfg())


def gptneox():
    torch.manual_seed(0)
    c = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)
    return transformers.GPTNeoXForCausalLM(c)


def distilbert():
    torch.manual_seed(0)
    c = transformers.DistilBertConfig(vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                      max_position_embeddings=64, pad_token_id=0)
    return transformers.DistilBertForMaskedLM(c)


def deit_loss(model, b):
    out = model(pixel_values=b["pixel_values"])
    return F.cross_entropy(out.cls_logits.float(), b["y"]) + F.cross_entropy(out.distillation_logits.float(),
                                                                              b["teacher_y"])


def deit_teacher_batch(k):
    x, y = img(k)
    flip = torch.rand(y.shape, generator=gen(600 + k % 4)) < 0.1   # a teacher that is right 90% of the time
    return dict(pixel_values=x, y=y, teacher_y=torch.where(flip, (y + 1) % 5, y))


def deit_batch(k):
    x, y = img(k)
    return dict(pixel_values=x, labels=y)


# ---------------------------------------------------------------------------------------------------- (a) healthy
def test_albert_shared_layers_fp16():
    healthy_case(albert, mlm_batch(3))


def test_qwen2moe_router_aux_fp16():
    r = healthy_case(qwen2moe, lm_batch)
    assert r["rep"].summary["steps"] >= 1


def test_cohere_tied_logit_scale_bf16():
    healthy_case(cohere, lm_batch, dtype=torch.bfloat16, lr=2e-2)


def test_deit_distillation_heads_bf16():
    healthy_case(deit_teacher, deit_teacher_batch, dtype=torch.bfloat16, loss_fn=deit_loss)


# --------------------------------------------------------------------------------------------------- (b) injected
def injected(build, batch, name, step, steps=12, factor=3e5):
    r = fit(build(), batch, steps, oracle=True, inject=scale_weight(name, step, factor))
    real_fail(r, name, step)
    expect_at(r["rep"], "overflow", name, (step,))


def test_albert_shared_ffn_overflow():
    injected(albert, mlm_batch(3), "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn", 6)


def test_gptneox_qkv_overflow():
    injected(gptneox, lm_batch, "gpt_neox.layers.1.attention.query_key_value", 5)


def test_qwen2moe_shared_expert_overflow():
    injected(qwen2moe, lm_batch, "model.layers.0.mlp.shared_expert.up_proj", 7)


def test_qwen2moe_fused_expert_overflow():
    name = "model.layers.1.mlp.experts"

    def inject(k, model):
        if k == 6:
            model.get_submodule(name).gate_up_proj[2].mul_(3e5)    # one expert of the fused 3-D weight
    r = fit(qwen2moe("eager"), lm_batch, 12, oracle=True, inject=inject)
    real_fail(r, name, 6)
    expect_at(r["rep"], "overflow", name, (6,))


def test_distilbert_ffn_overflow():
    injected(distilbert, mlm_batch(3), "distilbert.transformer.layer.1.ffn.lin1", 4)


def test_deit_intermediate_overflow():
    injected(deit_cls, deit_batch, "deit.layers.0.mlp.fc1", 8)


# ------------------------------------------------------------------------------------------ (b) mask / eps by hand
class HandMask(nn.Module):
    """Causal + padding 4D mask built by hand in fp16 with float32's min (the bug)."""

    def forward(self, attention_mask):
        t = attention_mask.shape[1]
        keep = attention_mask[:, None, None, :].to(torch.float16) * torch.ones(t, t).tril().to(torch.float16)
        return (1.0 - keep) * torch.finfo(torch.float32).min


class LeftPadLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        c = transformers.Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
        c._attn_implementation = "eager"
        self.mask = HandMask()
        self.lm = transformers.Phi3ForCausalLM(c)

    def forward(self, input_ids, attention_mask, labels):
        return self.lm(input_ids=input_ids, attention_mask=self.mask(attention_mask), labels=labels)


def leftpad_batch(k):
    b = lm_batch(k)
    if k >= 5:                                   # from step 5 ragged prompts, left-padded
        for i in range(0, 8, 2):
            n = 2 + i // 2
            b["input_ids"][i, :n] = 0
            b["attention_mask"][i, :n] = 0
            b["labels"][i, :n] = -100
    return b


def test_mask_f32min_in_fp16():
    m = LeftPadLM()
    nan_at = []
    attn = m.lm.model.layers[0].self_attn
    h = attn.register_forward_hook(lambda mod, i, o: nan_at.append(not finite(o)))
    r = fit(m, leftpad_batch, 10, oracle=True)
    h.remove()
    assert r["first"] == ("mask", 0), r["first"]
    assert nan_at.index(True) == 5, nan_at            # the first left-padded batch: NaN rows in attention
    assert 5 in r["skipped"] and all(s < 4 for s in r["skipped"] if s < 5), r["skipped"]
    expect_at(r["rep"], "mask_value_overflow", "mask", (0, 5), severity=("warning", "error"))


class HandLayerNorm(nn.Module):
    """A hand-written LayerNorm in its input's dtype, eps 1e-12 (BERT's value) — 0 in fp16."""

    def __init__(self, d, eps=1e-12):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class SensorEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        c = transformers.ElectraConfig(vocab_size=V, embedding_size=32, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
        self.proj = nn.Linear(12, 32, bias=False)
        self.norm = HandLayerNorm(32)
        self.backbone = transformers.ElectraModel(c)
        self.head = nn.Linear(32, 3)

    def forward(self, feats, y):
        h = self.backbone(inputs_embeds=self.norm(self.proj(feats))).last_hidden_state
        return F.cross_entropy(self.head(h[:, 0]).float(), y)


def sensor_batch(k):
    y = torch.randint(0, 3, (8,), generator=gen(400 + k % 4))
    x = torch.randn(8, 16, 12, generator=gen(500 + k % 4)) + y[:, None, None].float()
    if k == 6:
        x[:, 10:] = 0.0                              # a dropped link: the last frames are all zeros
    return dict(feats=x, y=y)


def test_layernorm_eps_1e12_fp16():
    r = fit(SensorEncoder(), sensor_batch, 10, oracle=True, loss_fn=lambda m, b: m(**b))
    real_fail(r, "norm", 6)
    expect_at(r["rep"], ("eps_underflow", "nan_origin"), "norm", (6,), severity=("warning", "error"))
