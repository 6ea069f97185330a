"""Cross-rank consistency diagnostics: loss, token, gradient-norm and gradient-direction
dispersion, gradient noise scale and alerts, measured on a dedicated process group."""
