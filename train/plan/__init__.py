"""The activation planner: what each layer's backward recomputes (`planner`, its search over dispatchers `search`,
the stored plan `record`), and the trainer's `auto` settings it resolves (`remat_auto`, `loss_chunk`)."""
