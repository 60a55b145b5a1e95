"""lvx: chat with hour-long videos using mPLUG-Owl3 and LV-XAttn."""

__version__ = "0.1.0"
