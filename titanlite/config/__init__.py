"""TOML configuration: dataclasses (job_config), loading and overrides (manager)."""

from titanlite.config.job_config import JobConfig
from titanlite.config.manager import load_config, parse_args

__all__ = ["JobConfig", "load_config", "parse_args"]
