"""Session setup shared by every test, including nbval's notebook items.

Kernels started by nbval and by our own notebook runner inherit this process's environment. With
``MPLBACKEND=Agg`` (common in CI images) matplotlib in the kernel draws nothing inline, so every plotting
cell loses the display output stored in the notebook and nbval reports "Missing output fields". Notebooks
must be compared under the inline backend they were executed with, so drop any other backend here.
"""

import os

if "inline" not in os.environ.get("MPLBACKEND", "inline"):
    os.environ.pop("MPLBACKEND")
