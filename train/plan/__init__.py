"""The activation planner: what each layer's backward recomputes (`planner`, its choice among policies `greedy`, its
search over dispatchers `search`, the stored plan `record`), and the trainer's `auto` settings it resolves
(`remat_auto`, `loss_chunk`)."""
