"""The run as the operating system sees it: its folder (plan, folder, files), its lock, stopping
on a signal (stop), and torchrun's arguments and failed ranks (torchrun)."""
