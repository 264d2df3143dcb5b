# Not timm's own __init__ (it imports every model, and timm.layers needs torchvision, whose wheel here cannot import
# beside the CPU torch): the package is only what timm's training loop uses from it. The modules under utils/ and
# scheduler/ are timm 1.0.31's, byte for byte.
