"""Real Hugging Face models (built from configs, no downloads): healthy runs stay quiet, injected overflow is
named at the producing module and op."""
import pytest
import torch

import ampdoctor

transformers = pytest.importorskip("transformers")


def _run(model, batch, steps=4, scaler=True, dtype=torch.float16):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    with ampdoctor.watch(model, opt, sc, every=1) as w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                out = model(**batch)
            if sc:
                sc.scale(out.loss).backward()
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                sc.step(opt)
                sc.update()
            else:
                out.loss.backward()
                opt.step()
    return w.report()


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 100, (4, 16), generator=g)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=100, decoder_start_token_id=0,
        pad_token_id=0))


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


@pytest.mark.parametrize("name", ["gpt2", "t5", "bert", "gpt2-bf16", "llama"])
def test_healthy_hf_models_raise_nothing(name):
    torch.manual_seed(0)
    ids = _ids()
    am = torch.ones_like(ids)
    am[1, 10:] = 0  # padding: additive finfo.min masks must not look like overflow
    if name.startswith("gpt2"):
        rep = _run(gpt2(), {"input_ids": ids, "labels": ids, "attention_mask": am}, scaler=name == "gpt2",
                   dtype=torch.bfloat16 if name.endswith("bf16") else torch.float16)
    elif name == "t5":
        rep = _run(t5(), {"input_ids": ids, "attention_mask": am, "labels": ids})
    elif name == "llama":
        rep = _run(llama(), {"input_ids": ids, "attention_mask": am, "labels": ids})
    else:
        rep = _run(bert(), {"input_ids": ids, "attention_mask": am, "labels": torch.tensor([0, 1, 0, 1])})
    assert not [f.one_line() for f in rep.findings if f.severity != "info"]


def test_t5_feed_forward_overflow_named_with_op():
    torch.manual_seed(0)
    m = t5()
    with torch.no_grad():
        m.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(1e5)
    ids = _ids()
    rep = _run(m, {"input_ids": ids, "labels": ids}, steps=2)
    f = rep.findings[0]
    assert (f.rule, f.module, f.phase) == ("overflow", "encoder.block.1.layer.1.DenseReluDense.wo", "forward")
    assert f.op == "aten::mm"


def test_gpt2_mlp_projection_overflow():
    torch.manual_seed(0)
    m = gpt2()
    with torch.no_grad():
        m.transformer.h[1].mlp.c_proj.weight.mul_(3e6)
    ids = _ids()
    rep = _run(m, {"input_ids": ids, "labels": ids}, steps=2)
    assert ("overflow", "transformer.h.1.mlp.c_proj") in [(f.rule, f.module) for f in rep.findings[:3]]


def test_llama_swiglu_product_overflow_names_the_mlp_not_its_activation():
    """`act_fn(gate_proj(x)) * up_proj(x)` overflows inside LlamaMLP.forward: the MLP is the producer (op: mul);
    its SiLU returning zeros for large negative inputs is correct arithmetic, not a silent overflow."""
    torch.manual_seed(0)
    m = llama()
    with torch.no_grad():
        m.model.layers[1].mlp.gate_proj.weight.mul_(1500)
        m.model.layers[1].mlp.up_proj.weight.mul_(1500)
    ids = _ids()
    rep = _run(m, {"input_ids": ids, "labels": ids}, steps=2)
    f = rep.findings[0]
    assert (f.rule, f.module, f.phase, f.op) == ("overflow", "model.layers.1.mlp", "forward", "aten::mul")
    assert not any(g.module == "model.layers.1.mlp.act_fn" for g in rep.findings)
