"""The attention backends a user may name (`--attn-backend`), without importing torch: the config
checks the option against them, the kernels (`backends.py`) pick by them; auto picks the best one
for each call."""

ATTN_BACKENDS = ("auto", "flash_attn", "cudnn", "flash", "efficient", "cpu", "math")
