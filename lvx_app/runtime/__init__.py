"""The engine's process plumbing: opening an engine in this process or as a torchrun group, the
command table, rank 0's driver and the other ranks' loop, the socket to the frontend process."""
