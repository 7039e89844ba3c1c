"""What keeps a run's work: its directory, one run at a time (`directory`), orbax checkpoints (`checkpoints`) and
stopping on a signal without losing a step (`preempt`)."""
