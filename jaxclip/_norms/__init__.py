"""The one numerics core: every norm jaxclip computes comes from here.

How the parts fit, from the data up::

    units      which arrays are reduced: leaves alone, or buckets of small leaves
      |
    passes     the common path: plain power sums (maxima for p=inf; Blue's single
      |        pass for 2-norms on GPU/TPU)
    rare       the one rare path: a sum out of its exact range is read again,
      |        shifted by a power of two
    slices     per-slice norms (a norm per leaf, slice or bucket row; a clip-norm floor)
    joint      joint norms: global (all leaves together) and per example
      |
    clip       clipping factors c / n and their application
    leafwise   per-leaf and per-slice clipping (clip_by_norm, AGC)

beside them: ``arith`` (:class:`Norm` ``frac * 2**exp``, exact powers and roots),
``backend`` (every backend-specific measure and the ``ONE_PASS`` switch),
``devices`` (the mapped axes a partial norm is combined over), ``rules`` (the one
derivative rule and the batching rule), ``stacking`` (scalar maths once for all leaves).

A p-norm ``(sum |x|^p)^(1/p)`` (``max |x|`` for ``p=inf``) costs one pass in the common
case: the plain power sum, accumulated in float32 (float64 for 64-bit leaves) with the
upcast fused into the reduction. Only when that sum overflowed, is NaN, or is too small
to be exact does a ``lax.cond`` take the rare path; float16 and float8 data, whose terms
cannot leave float32's range (``arith.always_exact``), compile none. Norms are carried
as ``(frac, exp)`` so the clipping factor ``c / n`` is exact at any magnitude. Where
the backend flushes subnormals (XLA:CPU does), subnormal float32 and bfloat16 inputs
count as zero in every norm; they are still returned bit for bit when nothing is
clipped.

The names below are the package's interface; the rest of jaxclip uses no other.
"""

from jaxclip._norms.arith import Norm as Norm
from jaxclip._norms.arith import acc_dtype as acc_dtype
from jaxclip._norms.arith import as_norm as as_norm
from jaxclip._norms.arith import frexp as frexp
from jaxclip._norms.arith import pow2 as pow2
from jaxclip._norms.arith import result_dtype as result_dtype
from jaxclip._norms.backend import Axes as Axes
from jaxclip._norms.backend import carry as carry
from jaxclip._norms.backend import max_keeping_nan as max_keeping_nan
from jaxclip._norms.clip import Factor as Factor
from jaxclip._norms.clip import apply_factors as apply_factors
from jaxclip._norms.clip import clip_factor as clip_factor
from jaxclip._norms.clip import clip_joint as clip_joint
from jaxclip._norms.clip import spread as spread
from jaxclip._norms.clip import summed_clipped as summed_clipped
from jaxclip._norms.devices import AxisName as AxisName
from jaxclip._norms.devices import LeafAxes as LeafAxes
from jaxclip._norms.devices import PerLeaf as PerLeaf
from jaxclip._norms.devices import combine_axes as combine_axes
from jaxclip._norms.devices import global_shape as global_shape
from jaxclip._norms.devices import kept_axes as kept_axes
from jaxclip._norms.devices import leaf_axes as leaf_axes
from jaxclip._norms.devices import leaves_axes as leaves_axes
from jaxclip._norms.devices import manual_axes as manual_axes
from jaxclip._norms.devices import one_device as one_device
from jaxclip._norms.devices import pmax as pmax
from jaxclip._norms.devices import varying as varying
from jaxclip._norms.devices import vma_tracked as vma_tracked
from jaxclip._norms.joint import global_norm as global_norm
from jaxclip._norms.joint import global_norm_parts as global_norm_parts
from jaxclip._norms.joint import per_example_norm_parts as per_example_norm_parts
from jaxclip._norms.leafwise import clip_leaves as clip_leaves
from jaxclip._norms.leafwise import clip_slices as clip_slices
from jaxclip._norms.leafwise import clip_slices_relative as clip_slices_relative
from jaxclip._norms.leafwise import slice_norms as slice_norms
