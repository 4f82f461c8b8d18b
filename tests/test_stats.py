"""Statistics of one tensor: hand-computed values, and the compiled CPU path equal to the eager reference."""
import math

import pytest
import torch

from ampdoctor.record.stats import compiled, full_stats, light_stats, vector_to_stats

from adversarial import adversarial

ADV = adversarial()


def test_hand_computed_fp32_as_fp16():
    s = vector_to_stats(full_stats(ADV, torch.float16).tolist(), "float32", "float16")
    assert (s.nan, s.posinf, s.neginf, s.zeros) == (1, 1, 1, 2)
    assert s.absmax == 1e6 and math.isclose(s.min_nonzero, 1e-9, rel_tol=1e-6)
    assert s.near_max == 6          # |x| >= 2^15: -4e4, 7e4, 1e6, 65504, 65519, 65520 (3e4 is below)
    assert s.overflow_as_ref == 3   # >= 65520 rounds to inf in fp16: 7e4, 1e6, 65520
    assert s.subnormal == 4         # 1e-9, 3e-7, 6e-5 (< 2^-14 = 6.1035e-5), 2^-24


@pytest.mark.parametrize("x,ref", [(ADV, torch.float16), (ADV.half(), torch.float16), (ADV.bfloat16(), torch.bfloat16),
                                   (ADV * 1e34, torch.bfloat16), (ADV, torch.float32), (torch.zeros(0), torch.float16),
                                   (torch.randn(64, 64).t(), torch.float16), (torch.zeros(100), torch.float16)])
def test_compiled_cpu_path_equals_eager(x, ref):
    for kind, eager in (("full", full_stats), ("light", light_stats)):
        got, want = compiled(kind)(x, ref), eager(x, ref)
        assert torch.equal(torch.nan_to_num(got, nan=-7.0), torch.nan_to_num(want, nan=-7.0)), (kind, got, want)


@pytest.mark.parametrize("x,ref", [(ADV, torch.float16), (ADV.half(), torch.float16), (ADV.bfloat16(), torch.bfloat16),
                                   (ADV * 1e34, torch.bfloat16), (ADV, torch.float32), (ADV.double(), torch.float16),
                                   (ADV.double() * 1e300, torch.float32), (torch.zeros(0), torch.float16),
                                   (torch.randn(64, 64).t(), torch.float16), (torch.randn(8, 64, 128)[:, ::2], torch.float16),
                                   (torch.zeros(100), torch.float16), (torch.randn(300_001) * 3e4, torch.float16),
                                   (torch.randn(300_001).half() * 1e-4, torch.float16),
                                   (torch.randn(200_000).bfloat16() * 1e37, torch.bfloat16)])
def test_c_cpu_path_equals_eager(x, ref):
    """ampdoctor/record/cpustats.py (one C pass, in chunks of 2^16 values) == the eager reference."""
    from ampdoctor.record import cpustats
    if not cpustats.available():
        pytest.skip("no C compiler here")
    big = x.clone().reshape(-1)
    if big.numel() > 1000:  # plant non-finite values and subnormals in different chunks
        big[::99_991] = float("nan")
        big[7::70_001] = float("inf")
        big[11::50_021] = -float("inf")
        big[13::40_009] = 0.0
        x = big.reshape(x.shape) if x.is_contiguous() else x
    got, want = cpustats.stats(x, ref), full_stats(x, ref)
    assert torch.equal(torch.nan_to_num(got, nan=-7.0), torch.nan_to_num(want, nan=-7.0)), (got, want)


def _mixed_chunks(dt: torch.dtype, n: int = 200_000) -> list[torch.Tensor]:
    """Tensors whose chunks (2^14 / 2^16 values) take different paths of the C pass: clean chunks next to a chunk
    with one near-max value, one with a cast overflow only, one with -0.0 and subnormals, one with a lone inf."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(n, generator=g).to(dt)
    near = base.clone()
    near[70_000] = 40_000.0 if dt != torch.float16 else 40_000.0
    ovf = base.clone()
    ovf[140_000] = 70_000.0 if dt != torch.float16 else 60_000.0
    small = base.clone()
    small[20_000:20_100] = -0.0
    small[20_100:20_110] = 1e-6
    small[150_000] = 2.0 ** -20
    lone = base.clone()
    lone[199_999] = -float("inf")
    relu = base.float().relu().to(dt)
    zeros = torch.zeros(n, dtype=dt)
    negzeros = -torch.zeros(n, dtype=dt)
    return [base, near, ovf, small, lone, relu, zeros, negzeros, base[: (1 << 14) + 1], base[: (1 << 16) - 1]]


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("ref", [torch.float16, torch.bfloat16])
def test_c_cpu_path_equals_eager_across_chunks(dt, ref):
    """The C pass takes a cheap route through chunks without large or non-finite values and passes the others
    again: every mix of such chunks gives the eager reference's numbers."""
    from ampdoctor.record import cpustats
    if not cpustats.available():
        pytest.skip("no C compiler here")
    for i, x in enumerate(_mixed_chunks(dt)):
        got, want = cpustats.stats(x, ref), full_stats(x, ref)
        assert torch.equal(torch.nan_to_num(got, nan=-7.0), torch.nan_to_num(want, nan=-7.0)), (i, got, want)


def test_the_steps_row_matrix_holds_what_stats_gives_each_tensor():
    """cpustats.RowBuffer (a step's CPU rows written in place into one matrix, grown past its first 128 rows) holds
    row for row what cpustats.stats returns, empty and non-contiguous tensors included."""
    from ampdoctor.record import cpustats
    if not cpustats.available():
        pytest.skip("no C compiler here")
    xs = [ADV, ADV.half(), ADV.bfloat16(), torch.zeros(0), torch.randn(64, 64).t(), ADV.double() * 1e300]
    xs = [(x, ref) for x in xs for ref in (torch.float16, torch.bfloat16)] * 12  # 144 rows
    buf = cpustats.RowBuffer()
    rows = [buf.add(x, ref) for x, ref in xs]
    assert rows == list(range(len(xs)))
    got = buf.vectors()
    want = torch.stack([cpustats.stats(x, ref) for x, ref in xs])
    assert torch.equal(torch.nan_to_num(got, nan=-7.0), torch.nan_to_num(want, nan=-7.0))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float64])
def test_abs_max_and_l2_in_one_pass_equal_torchs_norms(dt):
    """cpustats.absmax_l2 (a sampled step's gradients read once) gives torch's abs-max and `_foreach_norm(ord=2)`
    (bfloat16 normed as float32, as params.norms does), summed more exactly: inf and NaN propagate, a float32
    square past float32's range is inf and a tiny one 0, as in torch's."""
    from ampdoctor.record import cpustats
    if not cpustats.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(300_001, generator=g) * 3, torch.randn(37, 5, generator=g).t(), torch.tensor([1.0, float("inf")]),
          torch.tensor([float("-inf"), float("nan"), 2.0]), torch.full((4,), 3e38), torch.full((3,), -2.0 ** -130)]
    ts = [t.to(dt) for t in ts]
    amax, l2 = cpustats.absmax_l2(ts)
    want_a = torch.stack([t.abs().max().double() for t in ts])
    torchs = torch.stack(torch._foreach_norm([t.float() if dt == torch.bfloat16 else t for t in ts], 2)).double()
    # float32 squares summed exactly enough (torch sums them in float32: 2.5e-6 off on the 300k values here)
    truth = torch.stack([(t * t).double().sum().sqrt() if dt == torch.float64 else
                         (t.float() * t.float()).double().sum().sqrt().float().double() for t in ts])
    assert torch.equal(amax.nan_to_num(-7.0), want_a.nan_to_num(-7.0)), (amax, want_a)
    assert torch.allclose(l2.nan_to_num(-7.0), truth.nan_to_num(-7.0), rtol=1e-7, atol=0), (l2, truth)
    assert torch.allclose(l2.nan_to_num(-7.0), torchs.nan_to_num(-7.0), rtol=1e-4, atol=0), (l2, torchs)
    assert cpustats.absmax_l2([ts[0], torch.zeros(3, dtype=torch.float16)]) is None  # (float16: torch's norms)


def test_without_a_c_compiler_the_watch_falls_back(tmp_path):
    """No usable `cc` (CC=false, empty cache): cpustats is unavailable and a watched step still gets its
    statistics (eager here: every=20 does not compile)."""
    import subprocess
    import sys
    code = (
        "import torch, ampdoctor\n"
        "from ampdoctor.record import cpustats\n"
        "assert not cpustats.available()\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "with ampdoctor.watch(m, every=20) as w:\n"
        "    m(torch.randn(2, 4)).sum().backward()\n"
        "c = [c for c in w.steps[0].modules if c.module == '0'][0]\n"
        "assert c.out.numel == 16 and c.gout is not None\n"
        "print('ok')\n")
    env = dict(__import__("os").environ, CC="false", XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
