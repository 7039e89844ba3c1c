"""Attention kernels the model families share: one sequence per row (`causal`: XLA or cuDNN), packed documents
(`documents`, `cudnn_documents`), context parallelism over the expert axis (`context_parallel`) and cuDNN's
flash attention as its tiles (`cudnn`)."""
