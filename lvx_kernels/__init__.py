"""The attention kernels both the models and the application run: block attention returning
(out, lse) with its backends and grouped-query folding, the lse merge, the media masks, and the
`Feed` that tells a model's forward how its tokens lie over the ranks.

A leaf: it imports nothing of `lvx_app` or `lvx_models`, so both may import it. Importing the
package itself loads nothing (the config reads `backend_names` without torch)."""
