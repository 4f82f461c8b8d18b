"""Attribute py-spy samples (`py-spy record -f raw`) of a training loop to ampdoctor: a sample counts when its
innermost ampdoctor frame is deeper than its innermost frame of the plain step's own work (the model, the
optimizer, the scaler, clipping). Prints ampdoctor's share of the samples by function line, and the deepest
frames under them. With benchmarks/host_profile.py --spin:

    py-spy record -r 2000 -f raw -o def.txt -- python benchmarks/host_profile.py --spin default:20
    python benchmarks/pyspy_attr.py def.txt
"""
import collections, sys
tot=0; mine=collections.Counter(); n_ad=0; outside=collections.Counter()
PLAIN=("adam.py","nanogpt.py","clip_grad.py","functional.py","linear.py","autograd/__init__.py","sparse.py","normalization.py","_tensor.py (backward","grad_scaler.py","optimizer.py","modeling_gpt2.py","overhead.py (step","host_profile.py (main","tiny.py (step")
for line in open(sys.argv[1]):
    stack, _, cnt = line.rstrip().rpartition(' ')
    cnt=int(cnt)
    frames = stack.split(';')
    if any('Variant.__init__' in f or 'install' in f for f in frames): continue
    tot+=cnt
    idx_ad = max([i for i,f in enumerate(frames) if '(ampdoctor/' in f], default=-1)
    idx_pl = max([i for i,f in enumerate(frames) if any(k in f for k in PLAIN)], default=-1)
    if idx_ad > idx_pl:
        n_ad += cnt
        mine[frames[idx_ad]] += cnt
        if idx_ad < len(frames)-1: outside[frames[idx_ad] + ' -> ' + frames[-1]] += cnt
print("total", tot, "ampdoctor-attributed", n_ad, f"{n_ad/tot:.1%}")
for k,v in mine.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 25): print(f"{v/tot:6.2%} {k}")
print("-- deepest frames under ampdoctor")
for k,v in outside.most_common(15): print(f"{v/tot:6.2%} {k[:200]}")
