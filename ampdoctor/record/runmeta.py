"""What a watch records about the run when it begins (`RunMeta`): the module tree, the parameters and their dtypes,
the optimizer's groups and settings, the GradScaler's, the environment and the process. An optimizer or scaler the
watch finds later (`Watch.adopt_optimizer` / `adopt_scaler`) gets the same description here."""
from __future__ import annotations

import torch

from .. import __version__
from ..env import collect_env, deprecated_amp_in_use, process_info
from ..records import RunMeta
from ..tensors import module_type

__all__ = ["build_meta", "optimizer_meta", "scaler_meta", "masters_of", "groups"]


def build_meta(model, optimizer, scaler, every: int) -> RunMeta:
    import torch.distributed as dist
    mods = [[name, module_type(type(m)), name.count(".") + 1 if name else 0]
            for name, m in model.named_modules()]
    opt_ids = set()
    if optimizer is not None:
        opt_ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = []
    for name, p in model.named_parameters():
        params.append([name, name.rpartition(".")[0], str(p.dtype).replace("torch.", ""), p.numel(),
                       id(p) in opt_ids if optimizer is not None else None, p.requires_grad])
    opt = {}
    if optimizer is not None:
        opt = optimizer_meta(optimizer, model)
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in opt_ids for _, p in model.named_parameters()) and masters_of(model, held):
            opt["masters"] = True  # it steps copies of the model's weights (rules/weights.py: their dtype)
    sc = scaler_meta(scaler) if scaler is not None else {}
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    rank = world = None
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return RunMeta(ampdoctor_version=__version__, torch_version=torch.__version__,
                   model_class=module_type(type(model), qualified=True), modules=mods,
                   params=params, optimizer=opt, scaler=sc,
                   env=dict(collect_env(dev), deprecated_amp=deprecated_amp_in_use(scaler)),
                   every=every, rank=rank, world_size=world, process=process_info())


def optimizer_meta(optimizer, model) -> dict:
    """The optimizer's class, its parameters' dtypes and its groups (`groups`)."""
    dts = sorted({str(p.dtype).replace("torch.", "") for g in optimizer.param_groups for p in g["params"]})
    return {"class": type(optimizer).__name__, "param_dtypes": dts, "groups": groups(optimizer, model)}


def masters_of(model, opt_params: list) -> bool:
    """Whether an optimizer holding none of the model's parameters holds master copies of them (an fp16/bf16 model
    whose gradients are copied into fp32 masters that the optimizer steps): the same shapes, one for one, in fp32
    where the model's are low precision (an optimizer built from a second copy of the model is not). Copies in the
    model's own low precision are masters too, made wrong (`p.detach().clone()` of fp16 weights): the watch takes
    them, and `fp16_master_weights` says what they lack."""
    mine = [p for p in model.parameters() if p.requires_grad]
    if not mine or not any(p.dtype in (torch.float16, torch.bfloat16) for p in mine):
        return False
    if any(not p.is_floating_point() for p in opt_params):
        return False
    if any(p.dtype != torch.float32 for p in opt_params) and any(p.dtype == torch.float32 for p in mine):
        return False  # a second copy of a mixed-dtype model, not its masters
    if sorted(tuple(p.shape) for p in mine) == sorted(tuple(p.shape) for p in opt_params):
        return True
    # one flat fp32 master of all of them (fairseq's FP16Optimizer, flatten_params=True; one per device)
    return all(p.dim() == 1 and p.dtype == torch.float32 for p in opt_params) and \
        sum(p.numel() for p in opt_params) == sum(p.numel() for p in mine)


def scaler_meta(s) -> dict:
    return {"class": f"{type(s).__module__}.{type(s).__qualname__}", "enabled": bool(getattr(s, "_enabled", True)),
            "init_scale": float(getattr(s, "_init_scale", 0) or 0),
            "growth_factor": float(getattr(s, "_growth_factor", 2.0)),
            "backoff_factor": float(getattr(s, "_backoff_factor", 0.5)),
            "growth_interval": int(getattr(s, "_growth_interval", 2000)), "device": str(getattr(s, "_device", ""))}


def groups(optimizer, model) -> list[dict]:
    """Per param group: hyper-parameters that matter for precision (lr, eps) and its parameters' names/dtypes."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        d = {k: g[k] for k in ("lr", "eps", "weight_decay") if isinstance(g.get(k), (int, float))}
        eps = g.get("eps")
        if isinstance(eps, (tuple, list)) and all(e is None or isinstance(e, (int, float)) for e in eps):
            d["eps"] = list(eps)  # (Adafactor's pair: eps1 for the squared gradient, eps2 for the update's scale)
        if g.get("fused") is True:
            d["fused"] = True  # (torch's fused Adam/AdamW/SGD: the update's arithmetic in fp32 whatever the dtype)
        d["params"] = [[names.get(id(p), "?"), str(p.dtype).replace("torch.", "")] for p in g["params"]][:2000]
        out.append(d)
    return out
