"""Running a model across processes: tensor parallelism's rank 0 (tp.py), the other ranks
(worker.py) and what crosses between them (step.py). The collectives themselves are
kvserve/distributed/."""
