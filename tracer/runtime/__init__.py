"""The runtime: the compiled step, the scheduler and the running batch."""
