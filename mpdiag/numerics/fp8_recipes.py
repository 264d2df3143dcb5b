"""FP8 recipes: which format each role of an ``nn.Linear`` is cast to, and the per-tensor scale a recipe uses.

It owns the FP8 formats' limits and overflow rules, the settings of an FP8 recipe (:class:`Fp8Settings`) and
the scale arithmetic, written once for numpy arrays and torch tensors alike (``xp`` is the ``numpy`` or
``torch`` module), so the capture on the device, the ``fp8-sim`` level and the what-if page on stored amax
series compute bit-identical scales. It must not import torch (the dashboard process uses it) and does not
count anything: counting is :mod:`mpdiag.numerics.fp8`.

Recipes (NVIDIA Transformer Engine's names):

* **current**: scale = fmt_max / amax of the tensor itself, one fp32 division (torchao's tensorwise scaling).
* **delayed**: scale = fmt_max / max(amax of the H recorded steps before this one) / 2^margin; fewer than H at
  the start; the tensor's own amax at its first recorded step (TE's ``DelayedScaling``).
* ``pow2``: each scale rounded down to the largest power of two not above it (zeroing the fp32 mantissa).

Block-scaled recipes (``block_recipes``, recorded beside the per-tensor recipe, counted by
:mod:`mpdiag.numerics.block_scaled`): **mxfp8** (OCP MX v1.0: E4M3 elements, blocks of 32 along the last
dimension, an E8M0 power-of-two scale per block) and **nvfp4** (E2M1 elements, blocks of 16, an E4M3 scale per
block and an fp32 scale per tensor). The ``fp8-sim`` level simulates one (``recipe`` "mxfp8" or "nvfp4":
:mod:`mpdiag.training.fp8_sim`); a capture with such a recipe records it as a block recipe, beside both per-tensor
recipes. The what-if does not simulate them.

A reference amax that is zero or not finite gives scale 1 (TE keeps the previous scale instead; there is no
previous scale at a first step, and 1 keeps the rule stateless); a scale past fp32's range is clamped to the
largest fp32 value, so a zero stays zero when multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpdiag.numerics import formats
from mpdiag.numerics.formats import Format

UNDERFLOW, SUBNORMAL, NORMAL, OVERFLOW = range(4)


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 format's limits (magnitudes) and the rule for overflow of a value y about to be cast:
    ``|y| > overflow_above`` (E4M3, whose cast saturates) or ``|y| >= overflow_from`` (E5M2, whose cast
    gives inf). The limits are checked against ``torch.finfo`` in :mod:`mpdiag.numerics.fp8`."""

    name: str
    torch_dtype: str
    max_finite: float
    min_normal: float
    min_subnormal: float
    overflow_above: float | None = None
    overflow_from: float | None = None

    @property
    def overflow_threshold(self) -> float:
        """The magnitude where overflow starts (strictly above it for E4M3, from it for E5M2)."""
        return self.overflow_above if self.overflow_above is not None else self.overflow_from

    def overflows(self, magnitude: float) -> bool:
        if self.overflow_above is not None:
            return magnitude > self.overflow_above
        return magnitude >= self.overflow_from

    def category(self, magnitude: float) -> int:
        """Category of a finite non-zero magnitude about to be cast, by round to nearest even: UNDERFLOW
        (at most half the min subnormal: ties to 0), SUBNORMAL (below the midpoint between the largest
        subnormal and min normal, which rounds up to min normal), NORMAL, or OVERFLOW. Checked against
        torch's casts, edge by edge, in :mod:`mpdiag.numerics.fp8`."""
        if magnitude <= self.min_subnormal / 2:
            return UNDERFLOW
        if magnitude < self.min_normal - self.min_subnormal / 2:
            return SUBNORMAL
        return OVERFLOW if self.overflows(magnitude) else NORMAL


def _from_registry(fmt: Format) -> Fp8Format:
    """The recipe view of a registry format (its limits typed in once, in mpdiag.numerics.formats): E4M3's cast
    saturates, so it overflows above its threshold; E5M2's gives inf from the midpoint past its largest value,
    which ties to the even 65536, inf."""
    if fmt.overflow_above is not None:
        return Fp8Format(fmt.name, fmt.dtype_name, fmt.max_finite, fmt.min_normal, fmt.min_subnormal,
                         overflow_above=fmt.overflow_above)
    ulp = 2.0 ** (fmt.max_exponent - fmt.mantissa_bits)
    return Fp8Format(fmt.name, fmt.dtype_name, fmt.max_finite, fmt.min_normal, fmt.min_subnormal,
                     overflow_from=fmt.max_finite + ulp / 2)


FP8_E4M3 = _from_registry(formats.FP8_E4M3)  # overflow above 464, the midpoint to the next step (480)
FP8_E5M2 = _from_registry(formats.FP8_E5M2)  # overflow from 61440, the midpoint to 65536
FP8_FORMATS = {fmt.name: fmt for fmt in (FP8_E4M3, FP8_E5M2)}
#: the --fp8-grad-format choices
GRAD_FORMATS = {"e5m2": FP8_E5M2, "e4m3": FP8_E4M3}

ROLES = ("input", "weight", "grad_output")
CATEGORY_NAMES = ("underflow", "subnormal", "overflow")
RECIPES = ("current", "delayed")
#: the block-scaled recipes --fp8 can record beside RECIPES (their arithmetic: mpdiag.numerics.block_scaled)
BLOCK_RECIPES = ("mxfp8", "nvfp4")
FP32_MAX = float(np.finfo(np.float32).max)
#: what fp8-sim keeps a Linear in instead of casting it, and every recipe a Linear can be given (--fp8-modules)
HIGH_PRECISION = ("bf16", "fp32")
MODULE_RECIPES = (*RECIPES, *BLOCK_RECIPES, *HIGH_PRECISION)


@dataclass(frozen=True)
class Fp8Settings:
    """An FP8 recipe as the ``--fp8-*`` options give it.

    ``recipe``: "current", "delayed" or "both" (both only for recording), or a block recipe, "mxfp8" or "nvfp4"
    (simulated by ``fp8-sim``; recorded as a block recipe beside both per-tensor recipes); ``history``: H, recorded steps of
    amax history (delayed only); ``margin``: the delayed scale is divided by 2^margin; ``grad_format``:
    "e5m2" (HYBRID) or "e4m3" for output gradients; ``pow2``: round scales down to powers of two;
    ``bf16_modules``: names of Linear modules the ``fp8-sim`` level leaves in BF16 (a finding's fix);
    ``block_recipes``: block-scaled recipes (BLOCK_RECIPES) the capture also records, counted exactly;
    ``module_recipes``: (Linear name, recipe) pairs by which ``fp8-sim`` gives a module its own recipe, one of
    MODULE_RECIPES (a precision plan's rerun, :mod:`mpdiag.analysis.plan`); the others take ``recipe``.
    """

    recipe: str = "delayed"
    history: int = 1024
    margin: int = 0
    grad_format: str = "e5m2"
    pow2: bool = False
    bf16_modules: tuple[str, ...] = ()
    block_recipes: tuple[str, ...] = ()
    module_recipes: tuple[tuple[str, str], ...] = ()

    def validate(self) -> None:
        """Raise ValueError naming the option when a setting is invalid."""
        if self.recipe not in (*RECIPES, "both", *BLOCK_RECIPES):
            raise ValueError(f"--fp8-recipe must be current, delayed, both, mxfp8 or nvfp4, got {self.recipe!r}")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"--fp8-history must be an integer >= 1, got {self.history!r}")
        if not isinstance(self.margin, int) or not 0 <= self.margin <= 64:
            raise ValueError(f"--fp8-margin must be an integer from 0 to 64, got {self.margin!r}")
        if self.grad_format not in GRAD_FORMATS:
            raise ValueError(f"--fp8-grad-format must be e5m2 or e4m3, got {self.grad_format!r}")
        unknown = [r for r in self.block_recipes if r not in BLOCK_RECIPES]
        if unknown or len(set(self.block_recipes)) != len(self.block_recipes):
            raise ValueError(f"--fp8-blocks must name mxfp8 and/or nvfp4, each once, got {list(self.block_recipes)!r}")
        names = [name for name, _ in self.module_recipes]
        wrong = [f"{name}={recipe}" for name, recipe in self.module_recipes if recipe not in MODULE_RECIPES]
        if wrong or len(set(names)) != len(names):
            raise ValueError(f"--fp8-modules takes NAME=RECIPE, each name once, RECIPE one of "
                             f"{', '.join(MODULE_RECIPES)}; got {', '.join(wrong) or 'a name twice'}")

    @classmethod
    def from_dict(cls, values: dict) -> Fp8Settings:
        """Settings stored as ``dataclasses.asdict`` JSON (a Recorder's or watch's run config): the module list
        comes back as a list."""
        return cls(**{**values, "bf16_modules": tuple(values.get("bf16_modules", ())),
                      "block_recipes": tuple(values.get("block_recipes", ())),
                      "module_recipes": tuple(tuple(pair) for pair in values.get("module_recipes", ()))})

    def module_recipe(self, name: str) -> str:
        """The recipe fp8-sim gives Linear ``name``: "bf16" for one in ``bf16_modules``, its own from
        ``module_recipes``, else ``recipe``."""
        return "bf16" if name in self.bf16_modules else dict(self.module_recipes).get(name, self.recipe)

    @property
    def high_precision_modules(self) -> tuple[str, ...]:
        """The Linears fp8-sim does not cast at all (kept in BF16 or FP32)."""
        named = (*self.bf16_modules, *(name for name, _ in self.module_recipes))
        return tuple(dict.fromkeys(n for n in named if self.module_recipe(n) in HIGH_PRECISION))

    @property
    def is_block(self) -> bool:
        """Whether ``recipe`` is a block-scaled recipe (simulated by fp8-sim)."""
        return self.recipe in BLOCK_RECIPES

    @property
    def recipes(self) -> tuple[str, ...]:
        """The per-tensor recipes a capture counts: both for "both" and for a block recipe."""
        return RECIPES if self.recipe == "both" or self.is_block else (self.recipe,)

    @property
    def recorded_blocks(self) -> tuple[str, ...]:
        """The block recipes a capture counts: ``block_recipes``, and ``recipe`` where it is one."""
        extra = (self.recipe,) if self.is_block and self.recipe not in self.block_recipes else ()
        return (*self.block_recipes, *extra)

    def role_format(self, role: str) -> Fp8Format:
        """The format a recipe casts ``role`` to: E4M3 forward, the grad format backward."""
        return GRAD_FORMATS[self.grad_format] if role == "grad_output" else FP8_E4M3


def scale_from_reference(reference, fmt: Fp8Format, margin: int = 0, pow2: bool = False, xp=np):
    """fp32 scales from fp32 reference amaxes (a numpy array or a torch tensor, with ``xp`` its module):
    fmt_max / reference in one fp32 division, divided by 2^margin, rounded down to a power of two when
    ``pow2``; 1 where the reference is zero or not finite, the largest fp32 value where the division
    overflows."""
    if xp is np:
        reference = np.asarray(reference, dtype=np.float32)
    usable = xp.isfinite(reference) & (reference > 0)
    ones = xp.ones_like(reference)
    # a tensor / tensor division: torch computes ``number / tensor`` as number * reciprocal (two roundings)
    with np.errstate(over="ignore"):  # a tiny amax: the quotient is past fp32's range, clamped below
        scale = xp.full_like(reference, fmt.max_finite) / xp.where(usable, reference, ones)
    if margin:
        scale = scale / float(2**margin)  # exact: a power of two
    scale = xp.where(xp.isfinite(scale), scale, xp.full_like(scale, FP32_MAX))
    if pow2:  # keep sign and exponent bits: the largest power of two not above a positive normal value
        scale = (scale.view(xp.int32) & -(1 << 23)).view(xp.float32)
    return xp.where(usable, scale, ones)


def delayed_reference(amax: np.ndarray, history: int) -> np.ndarray:
    """The delayed recipe's reference amax at each recorded step of one tensor, from its amax series: the
    largest of the last ``history`` finite amaxes before it (fewer at the start), its own while none came
    before. A non-finite amax (a skipped step's gradient) never enters the window, as in the streaming
    version on the device: its own step reads inf or NaN only where it is the reference itself."""
    amax = np.asarray(amax, dtype=np.float32)
    if amax.size == 0:
        return amax
    finite = np.isfinite(amax)
    kept_before = np.cumsum(finite) - finite  # finite amaxes before each step
    padded = np.concatenate([np.zeros(history, np.float32), amax[finite]])  # zeros never raise a max of |x|
    window_max = np.lib.stride_tricks.sliding_window_view(padded, history).max(axis=1)  # [k]: the H before the k-th
    return np.where(kept_before > 0, window_max[kept_before], amax)


def recipe_scales(amax: np.ndarray, recipe: str, fmt: Fp8Format, settings: Fp8Settings) -> np.ndarray:
    """The scales ``recipe`` uses at each recorded step of one tensor whose amax series is ``amax``."""
    if recipe == "current":
        return scale_from_reference(amax, fmt, 0, settings.pow2)
    if recipe == "delayed":
        return scale_from_reference(delayed_reference(amax, settings.history), fmt, settings.margin, settings.pow2)
    raise ValueError(f"unknown FP8 recipe {recipe!r}")


def whatif_counts(hist: np.ndarray, exp_min: int, scale: float, fmt: Fp8Format,
                  amax: float | None = None) -> dict[str, tuple[int, int]]:
    """Lower and upper bounds of the underflow / subnormal / overflow counts of a tensor times ``scale`` in
    ``fmt``, from its exponent histogram alone (``hist[i]`` counts 2**(exp_min + i) <= |x| < 2**(exp_min + i + 1)).
    The values of a binade, scaled, lie between the fp32 products of its two ends; a binade whose two ends
    fall in one category counts in both bounds, one that straddles an edge only in the upper bounds of the
    categories it reaches. The FP8 edges (2^-10, 2^-6 - 2^-10, 464 for E4M3) lie inside binades, so a
    binade scaled onto one stays uncertain even at a power-of-two scale."""
    hist = np.asarray(hist, dtype=np.int64)
    bounds = {name: [0, 0] for name in CATEGORY_NAMES}
    s = np.float32(scale)
    with np.errstate(over="ignore"):
        top = float(np.float32(amax) * s) if amax is not None else float("inf")
        for i in np.flatnonzero(hist):
            low = float(np.float32(np.ldexp(np.float32(1), exp_min + int(i))) * s)
            high = min(float(np.float32(np.ldexp(np.float32(1), exp_min + int(i) + 1)) * s), top)
            first, last = fmt.category(low) if low > 0 else UNDERFLOW, fmt.category(high)
            for category, name in zip((UNDERFLOW, SUBNORMAL, OVERFLOW), CATEGORY_NAMES, strict=True):
                if first == last == category:
                    bounds[name][0] += int(hist[i])
                if first <= category <= last:
                    bounds[name][1] += int(hist[i])
    return {name: (low, high) for name, (low, high) in bounds.items()}
