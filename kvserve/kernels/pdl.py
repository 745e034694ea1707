"""The device side of programmatic dependent launch (see ``kernels.launch_pdl``)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_inputs(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible,
    then let the next kernel launch (it waits in turn before touching our output)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
