# Not timm's own __init__: see timm/__init__.py. cuda.py, clip_grad.py and agc.py are timm 1.0.31's, byte for byte.
from .clip_grad import dispatch_clip_grad
from .cuda import NativeScaler
