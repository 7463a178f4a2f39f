"""``prime_mega_moe``: prime-rl's import name for its DeepGEMM fork, served by primemoe's compatibility layer
(``primemoe.deep_gemm_compat``; DESIGN.md section 3)."""

from primemoe.deep_gemm_compat import *  # noqa: F401,F403
from primemoe.deep_gemm_compat import __all__  # noqa: F401
