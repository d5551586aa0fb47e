"""PyTorch integration: gradient buckets, the optimizer wrapper and hooks, the DDP
communication hook, the "fttree" torch.distributed backend, and ElasticJob (the whole exactly-once
loop). The only sub-package that
imports torch."""
