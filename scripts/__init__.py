"""Beside the product, not in it: benchmarks, the baselines LV-XAttn is measured against, the memory
plan, the emulated link and the GPU acceptance run (`docs/benchmarks.md`, `docs/gpu.md`).

Every script runs as `python3 scripts/NAME.py` from a checkout, installed or not: importing this
package makes the checkout's `lvx_app`, `lvx_models` and `lvx_ui` importable (`checkout.link`).
"""

from scripts.checkout import link

HOW_LVX_IMPORTS = link()
