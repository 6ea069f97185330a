"""Console logging with the rank in each line."""

from __future__ import annotations

import logging
import os


def init_logging() -> logging.Logger:
    logger = logging.getLogger("titanlite")
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[titanlite r{rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
