"""``python -m torchcomms.bench``: nccl-tests for torchcomms, side by side with raw gloo.

Modules, one concern each: ``cli`` (flags), ``launch`` (spawning local ranks), ``hosts``
(``--hosts``: simulated hosts in network namespaces), ``cases`` (the op table and each op's
buffers and calls), ``mpi`` (``--vs mpi``), ``runner`` (the timing harness), ``metrics``
(formulas), ``ceilings`` (the memory-bandwidth and TCP-wire probes, the ceiling of a cell),
``env`` (machine description), ``report`` (table, progress, JSON), ``plot`` (PNG),
``resources`` (what a process holds: the churn checks).
Not imported by ``torchcomms`` itself, so it may import ``torch.distributed``, the public API
and ``transport`` (the raw-gloo baseline's process group); nothing imports it back.
"""
