"""titanlite: a small torchtitan-style trainer whose loss path is exact by construction."""

__version__ = "0.1.0"
