"""tandem's compute kernels, one op per file.

Each op file holds a plain torch reference (`*_reference`, the definition tests compare
against), a CPU fast path, a Triton kernel for GPUs, and the dispatcher the engine calls, which
chooses by the tensors' device. Nothing here knows about requests, schedulers or models beyond
shapes and dtypes.

Note: PyPI has an unrelated project called `kernels`; this package is always imported from our
own tree (the editable install), never from site-packages.
"""
