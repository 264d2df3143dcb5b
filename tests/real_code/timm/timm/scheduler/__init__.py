# Not timm's own __init__: see timm/__init__.py. cosine_lr.py and scheduler.py are timm 1.0.31's, byte for byte.
from .cosine_lr import CosineLRScheduler
