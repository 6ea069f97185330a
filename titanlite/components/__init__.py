"""Trainer components: loss, optimizer + LR schedule, metrics, the log step's window, the spike
guard, fingerprints, eval, the run folder, checkpoints, pretrained Hugging Face weights."""
