"""The run as the operating system sees it: its folder and what it resumes (plan, torch-free,
for the launcher too; folder: opened by the workers; files: the records written into it), the
lock that keeps two runs out of one folder (lock), stopping on a signal with a checkpoint
(stop), and torchrun's arguments and failed ranks, for the launcher (torchrun)."""
