"""PyTorch's own DDP tests, run with torch's DDP and with tandem.DDP swapped in.

See docs/torch-ddp-suite.md.
"""
