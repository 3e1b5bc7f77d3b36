"""gpuwise: know what an AI workload needs, then train and serve it on the hardware you have."""

__version__ = "0.1.0"
