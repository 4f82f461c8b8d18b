"""Rebuild a Hugging Face model from a capture's config — the only model a capture alone may build.

A capture is data from a stranger, so nothing it names is imported or called. The one exception is a Hugging
Face config: its `model_type` must be one transformers knows, the class must be one transformers' own
`AutoModel*` registries map that `model_type` to (looked up by name, never imported from the capture's
string), and the model is built through that Auto class's `from_config` (no remote code). Before anything is
allocated the config's sizes are checked: integers sane, a rough parameter count no larger than the weights the
capture holds, then the real count on the meta device (no memory) no larger than those weights.
"""
from __future__ import annotations

import re

import torch

from ..errors import BadInput

__all__ = ["build_hf_model", "MAX_LAYERS", "MAX_WIDTH", "MAX_VOCAB"]

MAX_LAYERS = 4096          # no released transformer comes near; a config beyond it is refused unbuilt
MAX_WIDTH = 1 << 18        # hidden / intermediate sizes
MAX_VOCAB = 1 << 24
_DROP = ("model_type", "auto_map", "trust_remote_code", "custom_pipelines", "_name_or_path", "transformers_version")
_CLASS = re.compile(r"^transformers(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_LAYERS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "n_layer", "encoder_layers", "decoder_layers")
_WIDTH = ("hidden_size", "intermediate_size", "n_inner", "d_ff", "d_model", "n_embd", "d_kv", "num_attention_heads",
          "encoder_ffn_dim", "decoder_ffn_dim")
_LENGTH = ("max_position_embeddings", "n_positions")


def _int_field(config, name: str, hi: int) -> int:
    v = getattr(config, name, None)
    if v is None:
        return 0
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise BadInput(f"the capture's Hugging Face config has {name}={str(v)[:40]!r}; expected an integer in "
                       f"0..{hi}. Pass --model pkg.mod:factory to build the model yourself")
    return v


def _estimate(config) -> int:
    """A rough lower-bound parameter count (one h×h matrix per layer, the embeddings), from the sizes only."""
    layers = sum(_int_field(config, k, MAX_LAYERS) for k in _LAYERS)
    widths = [_int_field(config, k, MAX_WIDTH) for k in _WIDTH]
    vocab = _int_field(config, "vocab_size", MAX_VOCAB)
    pos = sum(_int_field(config, k, MAX_VOCAB) for k in _LENGTH)
    h = max(widths) if widths else 0
    return layers * h * h // 4 + (vocab + pos) * h // 4


def _auto_class(transformers, model_type: str, cls_name: str):
    """The transformers Auto class whose registry maps `model_type` to the class named `cls_name`."""
    for name in sorted(n for n in dir(transformers) if n.startswith("AutoModel")):
        auto = getattr(transformers, name, None)
        mapping = getattr(getattr(auto, "_model_mapping", None), "_model_mapping", None)
        if not isinstance(mapping, dict):
            continue
        names = mapping.get(model_type)
        names = names if isinstance(names, (list, tuple)) else (names,)
        if cls_name in names:
            return auto
    return None


def _numel_meta(auto, config) -> int:
    with torch.device("meta"):
        m = auto.from_config(config)
    return sum(t.numel() for t in m.state_dict().values())


def build_hf_model(model_class: str, hf_config: dict, state_numel: int) -> torch.nn.Module:
    """Build `model_class` (a transformers class) from `hf_config` through transformers' Auto registry."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise BadInput("the capture's Hugging Face config has no model_type; pass --model pkg.mod:factory")
    if not isinstance(model_class, str) or not _CLASS.match(model_class):
        raise BadInput(f"the capture names model class {model_class[:80]!r}, which is not a transformers class; "
                       "ampdoctor never imports classes a capture names: pass --model pkg.mod:factory")
    try:
        import transformers
    except ImportError:
        raise BadInput("this capture holds a Hugging Face config but transformers is not installed; install it or "
                       "pass model=/--model") from None
    from transformers import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        raise BadInput(f"the capture's Hugging Face config has model_type {model_type[:40]!r}, which this "
                       f"transformers ({transformers.__version__}) does not know; pass --model pkg.mod:factory")
    cls_name = model_class.rsplit(".", 1)[1]
    auto = _auto_class(transformers, model_type, cls_name)
    if auto is None:
        raise BadInput(f"{cls_name} is not a class transformers' AutoModel registries build for model_type "
                       f"{model_type!r}; pass --model pkg.mod:factory")
    cfg = {k: v for k, v in hf_config.items() if k not in _DROP}
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except Exception as e:  # a config transformers refuses: its message, one line
        raise BadInput(f"the capture's Hugging Face config was refused by transformers: {type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:200]}") from None
    est = _estimate(config)
    if est > 4 * state_numel + 4096:
        raise BadInput(f"the capture's Hugging Face config describes a model of at least ~{est:,} parameters but its "
                       f"weights hold {state_numel:,} values; refusing to build it (pass --model to build it yourself)")
    try:
        numel = _numel_meta(auto, config)
        if numel > state_numel:
            raise BadInput(f"the capture's Hugging Face config describes a model of {numel:,} weights but the "
                           f"capture holds {state_numel:,}; refusing to build it (pass --model)")
        return auto.from_config(config)
    except BadInput:
        raise
    except Exception as e:
        raise BadInput(f"transformers could not build {cls_name} from the capture's config: {type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:200]}") from None
