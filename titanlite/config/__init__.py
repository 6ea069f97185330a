"""TOML configuration: dataclasses (job_config), loading and overrides (manager), the command
line's words and what paths in a config mean (command_line)."""

from titanlite.config.command_line import parse_args, wants_help
from titanlite.config.job_config import JobConfig
from titanlite.config.manager import config_help, load_config

__all__ = ["JobConfig", "config_help", "load_config", "parse_args", "wants_help"]
