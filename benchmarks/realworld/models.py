"""The non-nanoGPT models of the corpus: Hugging Face GPT-2, Llama, T5 and BERT built from small configs
(random init, nothing downloaded), and a torchvision-style ResNet (BasicBlock, BatchNorm) of our own, each with
a batch maker that draws from the global RNG and the name of the projection an injected spike hits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- ResNet (torchvision.models.resnet, BasicBlock only) --------------------------------------------------------

def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes=10, width=64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- model specs -----------------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """How to build a model, draw a batch and get its loss; `spike` names the projection an injected weight
    spike multiplies (its forward op is a matmul/conv)."""

    name: str
    build: Callable[[str], nn.Module]            # size -> model
    batch: Callable[[str, str], tuple]           # (size, device) -> (args, kwargs, target); global RNG
    loss: Callable                               # (output, target) -> scalar loss
    spike: str                                   # qualified module name
    spike_ops: tuple = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
    lr: float = 3e-4


def _hf_loss(out, target=None):
    return out.loss


def _ids(size, device, vocab, T, B):
    ids = torch.randint(0, vocab, (B, T), device=device)
    am = torch.ones_like(ids)
    am[0, T - T // 4:] = 0  # one padded row: additive finfo.min masks must not look like an overflow
    return ids, am


_HF = {"tiny": dict(L=2, d=32, ff=64, h=2, V=100, T=16, B=4), "small": dict(L=4, d=256, ff=1024, h=4, V=8192,
                                                                            T=128, B=16)}


def gpt2(size):
    import transformers
    s = _HF[size]
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=s["L"], n_embd=s["d"], n_head=s["h"], vocab_size=s["V"], n_positions=max(64, s["T"])))


def llama(size):
    import transformers
    s = _HF[size]
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=s["V"], hidden_size=s["d"] * 2, intermediate_size=s["ff"] * 2, num_hidden_layers=s["L"],
        num_attention_heads=s["h"] * 2, num_key_value_heads=s["h"], max_position_embeddings=max(64, s["T"])))


def t5(size):
    import transformers
    s = _HF[size]
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=s["L"], d_model=s["d"], d_ff=s["ff"], num_heads=s["h"], d_kv=s["d"] // s["h"],
        vocab_size=s["V"], decoder_start_token_id=0, pad_token_id=0))


def bert(size):
    import transformers
    s = _HF[size]
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=s["L"], hidden_size=s["d"], num_attention_heads=s["h"], intermediate_size=s["ff"],
        vocab_size=s["V"], max_position_embeddings=max(64, s["T"])))


def _lm_batch(size, device):
    s = _HF[size]
    ids, am = _ids(size, device, s["V"], s["T"], s["B"])
    labels = ids.masked_fill(am == 0, -100)
    return (), {"input_ids": ids, "attention_mask": am, "labels": labels}, None


def _t5_batch(size, device):
    s = _HF[size]
    ids, am = _ids(size, device, s["V"], s["T"], s["B"])
    labels = torch.randint(1, s["V"], (s["B"], s["T"] // 2), device=device)
    return (), {"input_ids": ids, "attention_mask": am, "labels": labels}, None


def _mlm_batch(size, device):
    s = _HF[size]
    ids, am = _ids(size, device, s["V"], s["T"], s["B"])
    pick = (torch.rand(ids.shape, device=device) < 0.15) & (am == 1)
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    masked = torch.where(pick, torch.full_like(ids, 3), ids)  # token 3 plays [MASK]
    return (), {"input_ids": masked, "attention_mask": am, "labels": labels}, None


_RN = {"tiny": dict(layers=(1, 1, 1, 1), width=8, hw=32, B=8), "small": dict(layers=(2, 2, 2, 2), width=64, hw=64,
                                                                             B=64)}


def resnet(size):
    s = _RN[size]
    return ResNet(layers=s["layers"], width=s["width"])


def _img_batch(size, device):
    s = _RN[size]
    y = torch.randint(0, 10, (s["B"],), device=device)
    x = torch.randn(s["B"], 3, s["hw"], s["hw"], device=device) + 0.5 * y.view(-1, 1, 1, 1).float() / 10
    return (x,), {}, y


def _img_loss(out, target):
    """cross_entropy outside the model, as a torchvision loop does."""
    return F.cross_entropy(out, target)


SPECS = {
    "gpt2": ModelSpec("gpt2", gpt2, _lm_batch, _hf_loss, "transformer.h.1.mlp.c_fc"),
    "llama": ModelSpec("llama", llama, _lm_batch, _hf_loss, "model.layers.1.mlp.up_proj"),
    "t5": ModelSpec("t5", t5, _t5_batch, _hf_loss, "encoder.block.1.layer.1.DenseReluDense.wo"),
    "bert": ModelSpec("bert", bert, _mlm_batch, _hf_loss, "bert.encoder.layer.1.intermediate.dense"),
    "resnet": ModelSpec("resnet", resnet, _img_batch, _img_loss, "layer3.0.conv2",
                        spike_ops=("aten::convolution", "aten::conv2d", "aten::_convolution",
                                   "aten::mkldnn_convolution", "aten::cudnn_convolution"), lr=1e-3),
}

# the architectures of zoo.py (ViT, diffusion UNet, LSTM LM, VAE, mixture of experts, CLIP-style, ConvNeXt, wav2vec2-style
# CTC, GCN)
from . import zoo  # noqa: E402

_CONV = ("aten::convolution", "aten::conv2d", "aten::_convolution", "aten::mkldnn_convolution",
         "aten::cudnn_convolution", "aten::conv_transpose2d", "aten::slow_conv_transpose2d",
         "aten::cudnn_convolution_transpose", "aten::convolution_overrideable")


def _mse(out, target):
    return F.mse_loss(out.float(), target)


SPECS.update({
    "vit": ModelSpec("vit", zoo.vit, zoo.vit_batch, _img_loss, "blocks.1.mlp.0", lr=1e-3),
    "unet": ModelSpec("unet", zoo.unet, zoo.unet_batch, _mse, "down2.conv1", spike_ops=_CONV, lr=2e-4),
    "lstm": ModelSpec("lstm", zoo.lstm, zoo.lstm_batch, zoo.lm_loss, "proj", lr=1e-3),
    "vae": ModelSpec("vae", zoo.vae, zoo.vae_batch, zoo.own_loss, "dec.0", spike_ops=_CONV, lr=1e-3),
    "moe": ModelSpec("moe", zoo.moe, zoo.moe_batch, zoo.own_loss, "blocks.1.moe.experts.0.0", lr=1e-3),
    "clip": ModelSpec("clip", zoo.clip, zoo.clip_batch, zoo.own_loss, "text_proj", lr=5e-4),
    "convnext": ModelSpec("convnext", zoo.convnext, zoo.convnext_batch, _img_loss, "stages.1.2.pwconv1", lr=1e-3),
    "wav2vec": ModelSpec("wav2vec", zoo.wav2vec, zoo.wav2vec_batch, zoo.own_loss, "projection", lr=5e-4),
    "gcn": ModelSpec("gcn", zoo.gcn, zoo.gcn_batch, zoo.own_loss, "convs.0.lin", lr=1e-2),
})
