"""Model families in plain PyTorch (no torch.distributed in here), one folder each, listed in
`api.FAMILIES` (`lvx info` names them)."""
