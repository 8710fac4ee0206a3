"""Profile MetadataPipeline.update inside examples/flash_decode_step.py (device host)."""
import sys, cProfile, pstats, time, io, os
sys.path.insert(0, "examples"); sys.path.insert(0, ".")
import torch
if os.environ.get("ONE_THREAD"):
    torch.set_num_threads(1)
import dsv4_index
from dsv4_index import MetadataPipeline
import dsv4_index.state.owners as ow
orig = MetadataPipeline.update
pr = cProfile.Profile()
acc = {"n": 0, "t": 0.0, "own": 0.0}
mode = os.environ.get("MODE", "prof")
def wrapcheck(name):
    f = getattr(ow.BlockOwners, name)
    def g(self, *a, **k):
        t0 = time.perf_counter(); r = f(self, *a, **k); acc["own"] += time.perf_counter() - t0; return r
    setattr(ow.BlockOwners, name, g)
if mode == "share":
    wrapcheck("check"); wrapcheck("commit")
def upd(self, *a, **k):
    if mode == "prof":
        pr.enable(); r = orig(self, *a, **k); pr.disable()
    else:
        t0 = time.perf_counter(); r = orig(self, *a, **k); acc["t"] += time.perf_counter() - t0
    acc["n"] += 1
    return r
MetadataPipeline.update = upd
import flash_decode_step as ex
ex.main(["--steps", os.environ.get("STEPS", "120")])
print("updates", acc["n"], "mean us", acc["t"] / max(acc["n"], 1) * 1e6, "ownership mean us", acc["own"] / max(acc["n"], 1) * 1e6)
if mode == "prof":
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(40); st.sort_stats("cumulative").print_stats(40)
    print(s.getvalue())
