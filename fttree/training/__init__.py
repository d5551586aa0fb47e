"""PyTorch integration: gradient buckets, the optimizer wrapper and hooks, the DDP
communication hook and the "fttree" torch.distributed backend. The only sub-package that
imports torch."""
