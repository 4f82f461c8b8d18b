"""Extra peak memory of the per-step output check (a sum of the model's output in a wider dtype) on CUDA, for
GPT-2-sized bf16 and fp16 logits: which accumulation dtype allocates a copy of the output.

    python benchmarks/sum_peak.py
"""
import torch


def peak(dtype, acc):
    t = torch.randn(8, 1024, 50257, device="cuda").to(dtype)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = t.sum(dtype=acc)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20, float(s)


if __name__ == "__main__":
    for dt in (torch.bfloat16, torch.float16):
        for acc in (torch.float32, torch.float64):
            mib, _ = peak(dt, acc)
            print(f"{str(dt):16} sum(dtype={str(acc):14}) extra peak {mib:8.1f} MiB")
