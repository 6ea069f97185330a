"""The run as the operating system sees it: its folder and what it resumes (plan, torch-free,
for the launcher too; folder: opened by the workers), the lock that keeps two runs out of one
folder (lock), and stopping on a signal with a checkpoint (stop)."""
