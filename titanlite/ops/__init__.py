"""Pure tensor functions below every other layer: no config, no process group."""
