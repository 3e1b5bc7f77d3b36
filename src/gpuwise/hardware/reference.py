"""Published reference figures that several layers read: which GPUs a run is projected on, and what GPUs
really sustain on a CNN (Lambda's measured ResNet-50 training rates, lambdal/deeplearning-benchmark)."""

GiB = 2**30

PROJECT_ON = ("t4", "l4", "a100-80gb", "h100-sxm")  # a run's time and cost are projected on these

# Convolution nets reach a far smaller share of a GPU's peak than large transformers. Lambda's measured
# ResNet-50 training rates (images/s, FP32 / AMP) times the FLOPs of one ResNet-50 training image give
# what a GPU really sustains on a CNN.
RESNET50_TRAIN_FLOPS = 24.30e9  # one 224x224 image, forward + backward: torch's FlopCounterMode (a test recounts)
LAMBDA_RESNET50 = {
    "a10": (349, 638),
    "rtx-3090": (513, 905),
    "rtx-4090": (721, 1301),
    "a100-80gb": (1066, 1582),
    "h100-pcie": (1197, 1866),
    "h100-sxm": (1753, 2616),
}
LAMBDA_SOURCE = "Lambda deep-learning benchmark, ResNet-50 training, AMP images/s"
CONV_GPUS = ("a10", "rtx-4090", "a100-80gb", "h100-sxm")  # a CNN's run is projected on these
