"""What this machine's CPU build of torch can run, for tests that need it (a skip says why, not a failure)."""
import functools

import pytest
import torch


@functools.lru_cache(maxsize=None)
def _lstm_under_autocast(dtype: torch.dtype) -> str | None:
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.nn.LSTM(4, 4, batch_first=True)(torch.randn(1, 2, 4))
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]
    return None


def need_lstm_under_autocast(dtype: torch.dtype) -> None:
    """Skip unless an nn.LSTM runs under CPU autocast to `dtype` here (oneDNN on a CPU without AVX-512 has no
    low-precision LSTM primitive: "could not create a primitive descriptor for the LSTM forward propagation")."""
    err = _lstm_under_autocast(dtype)
    if err is not None:
        pytest.skip(f"this CPU runs no {dtype} nn.LSTM under autocast: {err}")
