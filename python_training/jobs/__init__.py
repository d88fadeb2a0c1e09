"""Tools for running a distillation recipe elsewhere: on a GPU machine, as jobs with a time limit,
on a machine that may be offline. Not the training library (that is ``python_training`` itself);
these drive it there and carry what it needs in and its results out.

- ``gpu_run``: a one-stage recipe as resumable jobs (collect, train, eval) within ``--minutes``,
  its results packed into parts (``jacobi-forcing gpu-run``, ``python -m
  python_training.jobs.gpu_run``).
- ``gpu_carry``: the wheels such a machine lacks, as a wheelhouse cut into parts here and
  assembled there; a run's state as a tar cut into parts (standard library only).
- ``gpu_setup.sh``: run at the start of every job there: stash the parts, install, build
  jacobi_ext in place, then ``gpu_run``.

docs/training.md "On a GPU machine" has the jobs step by step.
"""
