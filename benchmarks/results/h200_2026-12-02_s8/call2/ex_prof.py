"""Session 8, call 2: ``MetadataPipeline.update`` inside ``examples/flash_decode_step.py`` on the device host.

``MODE=share``: the ownership checks' time (``BlockOwners.check`` + ``commit``) beside ``update()``'s;
``MODE=prof``: a cProfile of ``update()`` only; ``ONE_THREAD=1``: ``torch.set_num_threads(1)`` first.
(Cleaned for the linter after the run; the logs beside it come from the same logic.)
The wrapper's "mean us" includes step 0 (the batch's admission); the example's own median line is the figure.
"""
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, "examples")
sys.path.insert(0, ".")
import torch  # noqa: E402

if os.environ.get("ONE_THREAD"):
    torch.set_num_threads(1)
import dsv4_index.state.owners as ow  # noqa: E402
from dsv4_index import MetadataPipeline  # noqa: E402

orig = MetadataPipeline.update
pr = cProfile.Profile()
acc = {"n": 0, "t": 0.0, "own": 0.0}
mode = os.environ.get("MODE", "prof")


def timed_owner(name):
    f = getattr(ow.BlockOwners, name)

    def g(self, *a, **k):
        t0 = time.perf_counter()
        r = f(self, *a, **k)
        acc["own"] += time.perf_counter() - t0
        return r
    setattr(ow.BlockOwners, name, g)


if mode == "share":
    timed_owner("check")
    timed_owner("commit")


def update(self, *a, **k):
    t0 = time.perf_counter()
    if mode == "prof":
        pr.enable()
    r = orig(self, *a, **k)
    if mode == "prof":
        pr.disable()
    acc["t"] += time.perf_counter() - t0
    acc["n"] += 1
    return r


MetadataPipeline.update = update
import flash_decode_step as ex  # noqa: E402

ex.main(["--steps", os.environ.get("STEPS", "120")])
n = max(acc["n"], 1)
print("updates", acc["n"], "mean us", acc["t"] / n * 1e6, "ownership mean us", acc["own"] / n * 1e6)
if mode == "prof":
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    print(s.getvalue())
