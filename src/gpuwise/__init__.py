"""gpuwise: know what an AI workload needs, then train and serve it on the hardware you have."""

import os

# MKL keeps the buffers of its matrix products in a cache of its own, outside torch's allocator, which
# about doubled a LoRA step's resident set at the same speed (docs/benchmarks.md). The switch is read when
# MKL starts, so it is set here, before anything imports torch; the user's own setting wins.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

__version__ = "0.1.0"
