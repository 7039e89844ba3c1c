"""`--profile`: the traced window (`window`), the trace's device events (`trace_events`) and the step's time by
part of the model (`step_parts`)."""
