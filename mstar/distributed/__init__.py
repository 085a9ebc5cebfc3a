"""Multi-rank replicas: process groups (groups.py), Ulysses attention (ulysses.py), sequence shards
(sequence.py). Importing the package imports no torch.distributed backend."""
