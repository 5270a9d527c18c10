"""Triton kernels with thin launchers on raw tensors; they import nothing else from the package
but its constants and layout arithmetic (``recipe``, ``layout``)."""
